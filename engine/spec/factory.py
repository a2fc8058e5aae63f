"""Build the proposer a speculative config asks for."""

from collections.abc import Callable

from engine.config import SpeculativeConfig
from engine.spec.proposer import NoProposer, Proposer


def make_proposer(config: SpeculativeConfig, runner, block_table: Callable[[str], list[int]]) -> Proposer:
    if config.method == "eagle3":
        from engine.spec.eagle3_proposer import MAX_TREE_TOKENS, Eagle3Proposer
        from engine.spec.ngram import LookupBranch

        eagle3 = Eagle3Proposer(runner, block_table, config.draft_confidence_threshold, config.draft_top_k,
                                config.draft_tree_width, config.speculative_token_tree)
        if not config.prompt_lookup_branch:
            return eagle3
        return LookupBranch(eagle3, config.prompt_lookup_min, config.prompt_lookup_max, MAX_TREE_TOKENS)
    if config.method == "ngram":
        from engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return NoProposer()
