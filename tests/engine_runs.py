"""Running an engine's requests to their end, outside any server: the speculative tests' way to
compare outputs token for token."""

from engine.engine import Engine


def run_requests(engine: Engine, prompts: list[list[int]], params: list) -> list[list[int]]:
    """Adds every request at once and steps the engine until all finish; each request's tokens."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return [out[i] for i in ids]
