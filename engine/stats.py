"""Statistics: an engine's snapshot for load reports and metrics, and a request's speculation
outcome (torch-free: the router and CLI report them)."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """What a worker reports about its engine (heartbeat load, Prometheus metrics). Read without
    waiting for the engine loop, so a value may be one step stale."""

    kv_blocks_used: int
    kv_blocks_total: int
    running: int  # sequences in the running batch
    waiting: int  # sequences waiting for a batch slot, KV blocks, or KV arriving from a prefill worker
    pinned: int  # prefilled here, blocks held until the decode side has them
    kv_blocks_waiting: int  # the blocks the waiting sequences' tokens fill: queued work, beside the used ones
    counters: dict[str, int]  # monotonic totals (tokens, finishes by reason, speculation)


@dataclass
class AcceptanceStats:
    """Speculation outcome of one request, over the steps that reserved draft slots (one whose
    draft the confidence threshold cut to nothing counts too: a forward that emitted one token)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times drafted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted

    def record(self, num_drafted: int, num_accepted: int, depth: int | None = None) -> None:
        """depth: draft positions reached (a tree's deepest path; default num_drafted, a chain)."""
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        for counts, n in ((self.drafted_at, num_drafted if depth is None else depth), (self.accepted_at, num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def merge(self, other: "AcceptanceStats") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        # accepted_at only grows as far as acceptance reached: positions beyond it were never accepted.
        accepted_at = self.accepted_at + [0] * (len(self.drafted_at) - len(self.accepted_at))
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "steps": self.steps,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "per_position_acceptance_rate": [round(a / d, 4) for a, d in zip(accepted_at, self.drafted_at)],
            "accepted_per_position": accepted_at,
        }
