"""EAGLE3 drafting on the paged draft cache: a chain, or EAGLE-2's dynamic tree.

Per sequence the proposer keeps the target's auxiliary features (projected by `fc`) for the
positions the draft has not yet seen with *target* features: after a prefill, the prompt; after
a verification, the last token and the accepted drafts (the draft's own KV written while
drafting them came from its own hidden states and is overwritten here). Proposing K tokens is:
1. one draft forward over all pending positions p (input: token p+1, hidden: target features
   at p), whose last row predicts the first draft token;
2. K-1 single-row forwards, each at the next position with the previous draft token and the
   draft's own output hidden state.
All sequences of the batch go through each forward together. With a tree width w > 1 (EAGLE-2),
each level drafts further from the w most likely new tokens (by path probability) instead of
one, and a level's forward reruns the tree's drafted nodes as a tree span (draft_tree.py): each
row sees the draft KV of its own ancestors only, at positions by depth.

With a confidence threshold P, a sequence's chain ends before the first token at which the
product of the draft's probabilities along the chain falls below P times the number of
sequences drafting. The product is the draft's estimate that the token and every one before it
are accepted (the head is calibrated: see its model card), i.e. the tokens it is expected to
add. A draft token costs about the same wall time at any batch size (a draft row and a
verification row), while a step's output grows with the batch, so it pays at batch B only if it
adds about B times what it must add at batch 1.

Above the engine's `disable_by_batch_size` nothing drafts and the engine captures no features
for decode steps (prompts' only): there a sequence's draft state is written as far as it goes and
dropped (as on release), and the draft cache misses the positions decoded meanwhile. Kept current
at batch 16, that upkeep cost 4-7 % of the step, for sequences most of which never draft again;
missing, it cost a sequence that drafted again after 96 such positions ~5 % of its tokens per
step, and a follow-up turn reusing such an answer from the prefix cache nothing measurable
(bench/draft_upkeep.py).
Below it, a sequence that drafts nothing this step (no slots reserved: a plain step of the
governor's, or P times the batch reached 1 so no chain can pass) only needs its draft cache up to
date for when it drafts again. Once some sequence lags more than CATCH_UP
positions behind, every sequence's pending positions but the last get their draft KV written in
one batched call that computes only the keys and values (not attention, MLP or logits: about a
tenth of a draft forward's arithmetic; on CPU one native call, Eagle3Draft.write_kv) and reads the
weights once instead of once per step. The same call covers the blocks a prompt's chunk fills (they
enter the prefix cache then), a prompt whose prefill is handed off, and what is still pending when a
sequence leaves (its full blocks stay in the prefix cache, and a request that reuses them reads
their draft entries too).
While a sequence lags, up to CATCH_UP of its positions have no draft entries yet; a request
reusing those blocks meanwhile drafts from stale ones there, which costs acceptance, never
correctness (verification decides every token). So does one entry of every prefix hit whose
prompt goes on differently: the entry at a reused block's last position was computed with the
token after it, the next block's first, which the block's hash does not cover; the new request
cannot rewrite it (the block is shared) and has no target features there to rewrite it from.

With top_k > 1, each draft step also proposes the head's next k - 1 choices at that position as
leaves of a tree: siblings of the chain's token, verified in the same target forward but not
drafted further. They cost no draft work (the chain's logits hold them) and one verification
row each, so they pass the same rule as the chain, by their path's probability (the chain's
before them times their own), and the most likely are kept when the tree would outgrow a
verification span.

The target's features reach `observe` one sequence at a time; they are projected by `fc` for the
whole batch at once, when next needed.
"""

from itertools import accumulate

import torch

from engine import cpu_kernels
from engine.attention import SHORT_QUERY
from engine.batch import SeqChunk
from engine.config import MAX_TREE_TOKENS
from engine.inference import inference
from engine.sequence import Sequence, SeqStatus
from engine.spec.draft_tree import DraftTree
from engine.spec.proposer import Proposal

assert MAX_TREE_TOKENS + 1 <= SHORT_QUERY  # a tree span ([last token] + drafts) is a short attention query
CATCH_UP = 32  # pending positions past which a sequence's draft cache is brought up to date


class Eagle3Proposer:
    needs_aux = True

    def __init__(self, runner, block_table, confidence_threshold: float = 0.0, top_k: int = 1, width: int = 1,
                 static_tree: list[list[int]] | None = None):
        """runner: the ModelRunner holding the draft and its cache; block_table(seq_id) -> block ids;
        confidence_threshold: per sequence drafting, the least product of draft probabilities a
        proposed token's path may have; top_k: candidates per drafted node; width: nodes drafted
        further per level (1: a chain); static_tree: a fixed shape instead (paths of ranks, see
        draft_tree.py), which sets top_k (and makes width moot)."""
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self.shape = None if static_tree is None else frozenset(map(tuple, static_tree))
        self.top_k = top_k if self.shape is None else 1 + max(r for p in self.shape for r in p)
        self.width = width  # a static tree ignores it
        self.draft = runner.draft
        self.block_table = block_table
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # seq -> (first position, hidden [n, H])
        self.unprojected: list[tuple[str, int, torch.Tensor]] = []  # (seq, first position, aux [n, 3H])
        self.unprojected_rows = 0  # their rows together (checked every step: not summed every step)
        self.positions_drafted = 0  # positions run through the draft with target features (a metric)

    def observe(self, seq: Sequence, start: int, aux: torch.Tensor | None) -> None:
        if aux is None:  # no features (above disable_by_batch_size): the draft state goes as far as it can
            if seq.seq_id in self.pending or self.unprojected:  # once: the sequence is not tracked after it
                self.release(seq)
            return
        self.unprojected.append((seq.seq_id, start, aux))
        self.unprojected_rows += aux.shape[0]

    @inference
    def release(self, seq: Sequence) -> None:
        """Write the draft KV still pending in the sequence's full blocks: they become prefix-cacheable,
        and a request that reuses them later reads their draft entries as well as the target's. (Its
        last, partial block is freed as it is: entries written there would never be read.)"""
        self._project()  # first, so none of its observed rows outlive it in `unprojected`
        if seq.status is SeqStatus.RUNNING:  # else it holds no blocks
            self.write_prompt_blocks([seq])
        self.pending.pop(seq.seq_id, None)

    @inference
    def write_prompt_blocks(self, seqs: list[Sequence]) -> None:
        """The draft KV of the full blocks a prompt's chunk has filled (`seqs`: mid-prompt this step, or
        one being released).
        Their target KV enters the prefix cache as they fill; left pending until the prompt's last
        chunk, a request reusing them meanwhile drafted from stale entries there, and a hand-off of
        that request shipped them so, into the decode worker's prefix cache."""
        self._project()
        self._catch_up([s for s in seqs if s.seq_id in self.pending], keep_last=False, full_blocks=True)

    def _project(self) -> None:
        """Move the observed target features into `pending`, through one `fc` for all of them."""
        if not self.unprojected:
            return
        # Grouped by sequence before the projection, so each sequence's new rows are one slice of
        # its output (slicing per observed step cost ~3 us a row: ~0.7 % of a batch-16 step).
        groups: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for seq_id, start, aux in self.unprojected:
            groups.setdefault(seq_id, []).append((start, aux))
        hidden = self.draft.project(torch.cat([aux for entries in groups.values() for _, aux in entries]))
        row = 0
        for seq_id, entries in groups.items():
            first, old = self.pending.get(seq_id, (entries[0][0], hidden[:0]))
            end, run = first + old.shape[0], row  # run: this sequence's first new row kept
            for start, aux in entries:
                if start != end:  # not contiguous (e.g. recomputed after preemption): restart here
                    first, old, run = start, hidden[:0], row
                end, row = start + aux.shape[0], row + aux.shape[0]
            self.pending[seq_id] = (first, torch.cat([old, hidden[run:row]]) if old.shape[0] else hidden[run:row])
        self.unprojected, self.unprojected_rows = [], 0

    @inference
    def prefill_draft(self, seq: Sequence, first_token: int) -> torch.Tensor | None:
        self._project()
        self._catch_up([seq])
        # Handed over: the prompt's last position, whose input token (the first token) is not in
        # seq.token_ids. A copy: pending rows may be views of a whole batch's projection.
        last, hidden = self.pending.pop(seq.seq_id)
        if (last + 1) % self.runner.config.block_size == 0:  # a full block: cached here, draft entries too
            self.runner.write_draft_kv([SeqChunk([first_token], last, self.block_table(seq.seq_id), num_logits=0)],
                                       hidden)
            self.positions_drafted += 1
        return hidden.clone()

    def adopt(self, seq: Sequence, position: int, hidden: torch.Tensor | None) -> None:
        if hidden is None:
            return
        width = self.draft.config.layer.hidden_size
        if tuple(hidden.shape) != (1, width):  # it would fail the next draft step, and that step's whole batch
            raise ValueError(f"draft hidden state of shape {tuple(hidden.shape)}; this head reads (1, {width})")
        self.pending[seq.seq_id] = (position, hidden.to(self.runner.device, self.runner.dtype))

    def propose(self, seqs: list[Sequence], chain_slots: list[int]) -> list[Proposal]:
        if not any(chain_slots) and self.unprojected_rows <= CATCH_UP * len(seqs):
            # Nobody drafts this step (a plain step of the governor's): the target's features wait,
            # to be projected and written in one batch when drafting resumes or they pile up. (Before
            # `inference`: even with the mode on already, this call took 55 us cold through it, 18
            # without.)
            return [Proposal([]) for _ in seqs]
        return self._propose(seqs, chain_slots)

    @inference
    def _propose(self, seqs: list[Sequence], chain_slots: list[int]) -> list[Proposal]:
        self._project()
        known = [(s, k) for s, k in zip(seqs, chain_slots) if s.seq_id in self.pending]
        if any(self.pending[s.seq_id][1].shape[0] > CATCH_UP for s, _ in known):
            self._catch_up([s for s, _ in known])
        drafting = [(s, min(k, MAX_TREE_TOKENS)) for s, k in known if k > 0]
        trees = self._draft(drafting) if drafting and self.confidence_threshold * len(drafting) < 1.0 else {}
        return [trees.get(s.seq_id, Proposal([])) for s in seqs]

    def _catch_up(self, seqs: list[Sequence], keep_last: bool = True, full_blocks: bool = False) -> None:
        """Write the draft cache's KV for the pending positions (full_blocks: those in the sequence's
        full blocks only), in one batched call that computes nothing else. keep_last: leave the last
        position unwritten. The newest position stays pending even when written (a prompt's chunk
        ending at a block's end): the next draft step reads its row, and writes it again alike."""
        chunks, hidden = [], []
        block_size = self.runner.config.block_size
        for seq in seqs:
            first, h = self.pending[seq.seq_id]
            # Position p needs token p+1: after a stop token, accepted drafts beyond it are not kept.
            room = seq.num_computed // block_size * block_size - first if full_blocks else h.shape[0]
            n = min(h.shape[0] - keep_last, len(seq.token_ids) - 1 - first, room)
            if n > 0:
                chunks.append(self._chunk(seq, first, n, num_logits=0))
                hidden.append(h[:n])
                kept = min(n, h.shape[0] - 1)
                self.pending[seq.seq_id] = (first + kept, h[kept:])
        if chunks:
            hidden = torch.cat(hidden)
            self.runner.write_draft_kv(chunks, hidden)
            self.positions_drafted += hidden.shape[0]

    def _chunk(self, seq: Sequence, first: int, num_positions: int, num_logits: int) -> SeqChunk:
        """Draft input over positions [first, first + num_positions): position p reads token p+1
        (the last pending position reads the newest token)."""
        return SeqChunk(seq.token_ids[first + 1 : first + 1 + num_positions], first,
                        self.block_table(seq.seq_id), num_logits=num_logits)

    def _take_pending(self, seqs: list[Sequence]) -> tuple[list[SeqChunk], torch.Tensor]:
        """The first draft forward's input: each sequence's pending positions (target features)."""
        chunks, hidden = [], []
        for seq in seqs:
            first, h = self.pending.pop(seq.seq_id)
            chunks.append(self._chunk(seq, first, h.shape[0], num_logits=1))
            hidden.append(h)
        hidden = torch.cat(hidden)
        self.positions_drafted += hidden.shape[0]
        return chunks, hidden

    def _draft(self, active: list[tuple[Sequence, int]]) -> dict[str, Proposal]:
        """Each sequence's draft tree (see draft_tree.py), grown a level per draft forward for all
        sequences together."""
        seqs = [s for s, _ in active]
        chunks, hidden = self._take_pending(seqs)
        trees = {s.seq_id: DraftTree(self.width, k, self.confidence_threshold * len(seqs), self.shape) for s, k in active}
        roots = [(c, hidden[row]) for c, row in zip(chunks, _last_rows(chunks))]  # (chunk, root input hidden)
        out_hidden: dict[tuple[str, int], torch.Tensor] = {}  # (seq, node or -1) -> its row's draft output
        expanding = [(seq, -1) for seq in seqs]  # (sequence, node) rows whose logits this forward gives
        while expanding:
            out = self.runner.forward_draft(chunks, hidden)
            rows = [r for c, last in zip(chunks, _last_rows(chunks)) for r in range(last + 1 - c.num_logits, last + 1)]
            parent_prob = [trees[s.seq_id].nodes[n].prob if n >= 0 else 1.0 for s, n in expanding]
            choices, path_prob = self._choose(out.logits, parent_prob)
            for (seq, node), row, tokens, probs in zip(expanding, rows, choices, path_prob):
                out_hidden[seq.seq_id, node] = out.hidden[row]
                trees[seq.seq_id].add_children(node, tokens, probs)
            chunks, hidden, expanding = self._next_level(seqs, trees, roots, out_hidden)
        return {seq_id: tree.proposal(MAX_TREE_TOKENS) for seq_id, tree in trees.items()}

    def _next_level(self, seqs: list[Sequence], trees: dict[str, DraftTree],
                    roots: list[tuple[SeqChunk, torch.Tensor]], out_hidden: dict[tuple[str, int], torch.Tensor],
                    ) -> tuple[list[SeqChunk], torch.Tensor | None, list[tuple[Sequence, int]]]:
        """The next draft forward: for each sequence that grew a new frontier with room to expand,
        its frontier's rows. A chain needs only them (everything before is an ancestor); a wider
        tree reruns its expanded nodes as a tree span, so each row sees its own ancestors only."""
        chunks, hidden, expanding = [], [], []
        for seq, (root_chunk, root_hidden) in zip(seqs, roots):
            tree = trees[seq.seq_id]
            if not tree.grow() or not tree.expands():
                continue
            depth_start = root_chunk.end  # position of the first level's row (the root's row is end - 1)
            if tree.is_chain():
                node = tree.nodes[tree.frontier[0]]
                chunks.append(SeqChunk([node.token], depth_start + len(tree.spine) - 1, root_chunk.block_table,
                                       num_logits=1))
                hidden.append(out_hidden[seq.seq_id, node.parent][None])
            else:
                spine = [tree.nodes[n] for n in tree.spine]
                index = {n: k for k, n in enumerate(tree.spine)} | {-1: -1}
                chunks.append(SeqChunk([root_chunk.token_ids[-1]] + [node.token for node in spine], depth_start - 1,
                                       root_chunk.block_table, num_logits=len(tree.frontier),
                                       draft_parents=[index[node.parent] for node in spine]))
                hidden.append(torch.stack([root_hidden] + [out_hidden[seq.seq_id, node.parent] for node in spine]))
            expanding += [(seq, n) for n in tree.frontier]
        return chunks, torch.cat(hidden) if hidden else None, expanding

    def _choose(self, logits: torch.Tensor, parent_prob: list[float]) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's top_k tokens (target ids, most likely first) and their path probabilities
        (the parent's times their own). On CPU one native pass a row (torch's softmax and topk took
        35-85 us a level); elsewhere all ones when nothing needs them: no threshold, and a plain chain
        (a tree's leaves are cut by their probabilities)."""
        if logits.device.type == "cpu":
            choice, prob = cpu_kernels.kernels().top_probs(logits, self.top_k)
        elif self.confidence_threshold == 0.0 and self.width == 1 and self.top_k == 1:  # one transfer
            choice = logits.topk(self.top_k, dim=-1).indices.tolist()
            prob = [[1.0] * self.top_k for _ in choice]
        else:
            values, indices = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
            choice, prob = indices.tolist(), values.tolist()
        return self.draft.to_target_ids(choice), [[parent * p for p in row] for parent, row in zip(parent_prob, prob)]


def _last_rows(chunks: list[SeqChunk]) -> list[int]:
    """Each chunk's last row in the forward's concatenated rows."""
    return [end - 1 for end in accumulate(len(c.token_ids) for c in chunks)]
