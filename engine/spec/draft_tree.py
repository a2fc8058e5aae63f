"""One sequence's EAGLE draft tree while it is drafted (EAGLE-2's dynamic tree), no tensors.

Nodes are draft tokens below the root (the sequence's newest token), each with its parent and
its path probability: the product of the draft's probabilities from the root down to it, the
draft's estimate that the target accepts it and every token above it. Each level, the `width`
most likely new nodes that pass the threshold join the spine; the spine's nodes are run through
the draft (expanded) to get their children, the last level's are kept unexpanded. The spine
holds at most `max_spine` nodes (the draft KV slots reserved for them). Width 1 makes the spine a
chain. The other children of expanded nodes are leaves: verified, not drafted further.

The verified tree is the spine, then the most likely leaves that fit (`max_tokens` in all), in an
order where parents precede their children.

A static tree (`shape`: the paths of ranks from the root that may be nodes, vLLM's
`speculative_token_tree`) keeps only the candidates on its paths, and its spine is their inner
nodes (those with children in the shape), whatever the width.
"""

from dataclasses import dataclass

from engine.spec.proposer import Proposal


@dataclass
class Node:
    token: int
    parent: int  # index into DraftTree.nodes; -1: the root
    prob: float  # path probability
    path: tuple[int, ...]  # ranks from the root: (0, 1) is the root's first candidate's second


class DraftTree:
    def __init__(self, width: int, max_spine: int, threshold: float, shape: frozenset[tuple[int, ...]] | None = None):
        self.width, self.max_spine, self.threshold, self.shape = width, max_spine, threshold, shape
        self._inner = None if shape is None else {p[:-1] for p in shape}
        self.nodes: list[Node] = []
        self.spine: list[int] = []  # node indices, level by level
        self.frontier: list[int] = []  # the spine's newest level: expanded next
        self._level_start = 0  # nodes from here on were added since the last grow()

    def add_children(self, parent: int, tokens: list[int], probs: list[float]) -> None:
        """The draft's candidates after `parent` (-1: the root), most likely first, with their
        path probabilities."""
        above = self.nodes[parent].path if parent >= 0 else ()
        for rank, (token, prob) in enumerate(zip(tokens, probs)):
            if self.shape is None or above + (rank,) in self.shape:
                self.nodes.append(Node(token, parent, prob, above + (rank,)))

    def grow(self) -> list[int]:
        """The nodes added since the last grow are this level's candidates: the `width` most likely
        that pass the threshold and fit join the spine as the next frontier, which is returned
        (empty, changing nothing, when no node was added)."""
        if self._level_start == len(self.nodes):
            return []
        room = self.max_spine - len(self.spine)
        ranked = sorted(range(self._level_start, len(self.nodes)), key=lambda i: -self.nodes[i].prob)
        self._level_start = len(self.nodes)
        ranked = ranked[: self.width] if self._inner is None else [i for i in ranked if self.nodes[i].path in self._inner]
        self.frontier = [i for i in ranked[:room] if self.nodes[i].prob >= self.threshold]
        self.spine += self.frontier
        return self.frontier

    def expands(self) -> bool:
        """Whether the frontier is drafted further: a static tree's (its inner nodes) while their
        children are no deeper than the sequence's draft slots (its K, or what it may still emit), a
        dynamic one's while the spine has room for another level."""
        if not self.frontier:
            return False
        if self.shape is not None:
            return len(self.nodes[self.frontier[0]].path) < self.max_spine  # a level's nodes share a depth
        return len(self.spine) < self.max_spine

    def is_chain(self) -> bool:
        """Each spine node continues the one before it (width 1, or a single survivor per level)."""
        return all(self.nodes[n].parent == (self.spine[k - 1] if k else -1) for k, n in enumerate(self.spine))

    def proposal(self, max_tokens: int) -> Proposal:
        """The spine, then the most likely leaves that pass the threshold, max_tokens in all."""
        in_spine = set(self.spine)
        expanded = in_spine.difference(self.frontier) | {-1}
        leaves = sorted((i for i, n in enumerate(self.nodes)
                         if i not in in_spine and n.parent in expanded and n.prob >= self.threshold),
                        key=lambda i: -self.nodes[i].prob)
        chosen = self.spine + leaves[: max(0, max_tokens - len(self.spine))]
        position = {node: k for k, node in enumerate(chosen)} | {-1: -1}
        tokens = [self.nodes[i].token for i in chosen]
        parents = [position[self.nodes[i].parent] for i in chosen]
        return Proposal(tokens, None if parents == list(range(-1, len(tokens) - 1)) else parents)
