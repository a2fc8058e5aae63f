"""Triton verification against the torch reference, run on CPU by the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, and other tests in the session may
already have imported it, so the comparison runs in a subprocess: this file executed as a script
(`python -m tests.test_triton_rejection`) runs every case and prints the results as JSON; the
pytest side runs it once and asserts per case.

The kernel's CDF accumulates in fp32 and the reference's in fp64, so in general a draw could
differ when u lands within ~1e-6 of a CDF boundary. Here the probabilities are multiples of 2^-14
and the uniforms multiples of 2^-10: every partial sum and threshold u * total is then exact in
fp32, so the two must agree token for token. The forced sequences add the edge cases on top:
thresholds equal to a CDF value (u = 0 and u = 1/2; the draw is the first index whose CDF
strictly exceeds it), and u just below 1 (the last token with weight, also where the fp32 CDF
ends short of the threshold: _lossy_cdf_row). The bf16 cases' sums are still exact (multiples
of 2^-21) but their thresholds u * total are not, so those cases rely on their fixed seeds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROB_BITS = 14
UNIFORM_BITS = 10
# The largest fp32 below 1.
ALMOST_ONE = 1.0 - 2.0 ** -24

# (name, vocab, probs dtype, sequences). A sequence is (num_drafts, kind, forced) with kind
# "g"reedy, "s"ampled, or "f": sampled, no drafts, a bonus row from _lossy_cdf_row.
# forced = k: exactly k drafts accepted (k = num_drafts: full acceptance, 0: immediate rejection)
# with the edge cases above; None: the target's argmax as drafts (a real drafter's guess). BLOCK_V is 1024, so vocab 2500
# samples across three chunks. A trailing True turns the greedy sequences' drafts into trees.
GREEDY = [(0, "g", 0), (1, "g", 1), (3, "g", 0), (5, "g", 5), (5, "g", 2), (3, "g", None), (5, "g", None)]
SAMPLED = [(0, "s", 0), (1, "s", 1), (3, "s", 0), (5, "s", 5), (5, "s", 2), (3, "s", None), (5, "s", None),
           (5, "s", None), (0, "f", 0)]
MIXED = [(5, "s", None), (3, "g", 3), (0, "s", 0), (5, "g", None), (1, "s", 0), (5, "s", 5), (3, "g", 0),
         (4, "s", None)]
CASES = [
    ("greedy-v37", 37, "float32", GREEDY),
    ("greedy-v1000", 1000, "float32", GREEDY),
    ("sampled-v37", 37, "float32", SAMPLED),
    ("sampled-v2500", 2500, "float32", SAMPLED),
    ("mixed-v1000", 1000, "float32", MIXED),
    ("mixed-v2500", 2500, "float32", MIXED),
    ("mixed-v1000-bf16", 1000, "bfloat16", MIXED),
    # Trees (see _with_trees).
    ("trees-v37", 37, "float32", GREEDY + GREEDY, True),
    ("trees-sampled-v37", 37, "float32", SAMPLED + SAMPLED, True),
    ("trees-mixed-v1000", 1000, "float32", MIXED, True),
    ("trees-mixed-v2500-bf16", 2500, "bfloat16", MIXED + MIXED, True),
]


def _dyadic_probs(logits, dtype):
    """softmax(logits) rounded down to multiples of 2^-PROB_BITS, the remainder on the argmax,
    then to dtype (held in fp32, so that the test's choices see the values the kernels see)."""
    import torch

    scale = 2 ** PROB_BITS
    counts = (torch.softmax(logits.double(), -1) * scale).floor()
    counts[torch.arange(logits.shape[0]), logits.argmax(-1)] += scale - counts.sum(-1)
    return (counts / scale).to(dtype).float()


def _with_cdf_tie(p, u: float):
    """p (multiples of 2^-PROB_BITS summing to 1) with mass moved so that a CDF value equals u."""
    counts = (p.double() * 2 ** PROB_BITS).round()
    if u == 0:  # no weight before index 3: the sample must skip the zero-weight prefix
        counts[3 + int(counts[3:].argmax())] += counts[:3].sum()
        counts[:3] = 0
    else:
        target = u * 2 ** PROB_BITS
        k = int((counts.cumsum(0) >= target).nonzero()[0])
        assert k + 1 < counts.shape[0]
        excess = counts[: k + 1].sum() - target
        counts[k] -= excess
        counts[k + 1] += excess
    return (counts / 2 ** PROB_BITS).float()


def _lossy_cdf_row(vocab: int):
    """A distribution ending in zeros on which the fp32 CDF stops short of u * total for u near 1.

    Each 2^-25 entry after the 0.5 is a rounding tie that a running sum drops, while a tree sum
    (the total) keeps them together (the interpreter's tl.cumsum and tl.sum are np.cumsum and
    np.sum): the final CDF value, 1 - 2^-20, is below the threshold
    (1 - 2^-24) * ~1. Exact arithmetic picks the 1/2 - 2^-20 entry, the last one with weight; a
    kernel that clamps to the last index instead would pick a zero-probability token."""
    import torch

    p = torch.zeros(vocab)
    p[vocab - 36] = 0.5
    p[vocab - 35 : vocab - 3] = 2.0 ** -25
    p[vocab - 3] = 0.5 - 2.0 ** -20
    return p


def _make_input(vocab: int, dtype: str, seqs: list, seed: int):
    import torch

    from engine.spec.rejection import VerifyInput

    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(n + 1 for n, _, _ in seqs)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(dtype).float()
    argmax = logits.argmax(-1)
    probs = _dyadic_probs(logits, dtype)
    uniforms = torch.randint(0, 2 ** UNIFORM_BITS, (num_rows,), generator=gen) / 2 ** UNIFORM_BITS
    draft_ids = []
    row = 0
    for n, kind, forced in seqs:
        for i in range(n):
            r = row + i
            if kind == "g":
                hit = i < forced if forced is not None else torch.rand(1, generator=gen).item() < 0.7
                miss = (int(argmax[r]) + 1 + int(torch.randint(0, vocab - 1, (1,), generator=gen))) % vocab
                d = int(argmax[r]) if hit else miss
            elif forced is not None and i < forced:
                d = _draw(probs, uniforms, r)  # the row's own draw: accepted
            elif forced is not None and i == forced:
                uniforms[r] = ALMOST_ONE  # the draw is the last token with weight, the draft another
                d = (_draw(probs, uniforms, r) + 1) % vocab
            else:
                d = int(argmax[r])  # drafts are greedy, like a real drafter's
            draft_ids.append(d)
        if kind == "g":
            probs[row : row + n + 1] = float("nan")  # greedy rows of p are never read
        elif kind == "f":
            probs[row] = _lossy_cdf_row(vocab)
            uniforms[row] = ALMOST_ONE
        elif forced == n:  # the bonus row is sampled: make its threshold a CDF value
            u = 0.0 if n == 0 else 0.5
            probs[row + n] = _with_cdf_tie(probs[row + n], u).to(dtype).float()
            uniforms[row + n] = u
        row += n + 1
    all_greedy = all(kind == "g" for _, kind, _ in seqs)
    ends = [sum(n for n, _, _ in seqs[: i + 1]) for i in range(len(seqs))]
    return VerifyInput(
        drafts=[draft_ids[end - n : end] for (n, _, _), end in zip(seqs, ends)],
        target_logits=logits.to(dtype),
        target_probs=None if all_greedy else probs.to(dtype),
        greedy=[kind == "g" for _, kind, _ in seqs],
        uniforms=uniforms,
    )


def _draw(probs, uniforms, row: int) -> int:
    """The reference's draw at a row (its inverse CDF by the row's uniform)."""
    from engine.spec.rejection import inverse_cdf

    return inverse_cdf(probs[row : row + 1], uniforms[row : row + 1])[0]


def _with_trees(inp, seqs: list, seed: int):
    """inp with its greedy and sampled sequences' drafts re-parented into random trees, each draft
    set to the target's choice after its parent (argmax, or draw) 60 % of the time (so paths go
    deep and also end at siblings); the edge-case kinds keep chains."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    argmax = inp.target_logits.argmax(-1).tolist()
    inp.parents = []
    row = 0
    for (n, kind, _), drafts in zip(seqs, inp.drafts):
        parents = []
        for i in range(n):
            tree = kind in ("g", "s")
            parents.append(int(torch.randint(-1, i, (1,), generator=gen)) if tree else i - 1)
            if tree and torch.rand(1, generator=gen).item() < 0.6:
                at = row + 1 + parents[-1]
                drafts[i] = argmax[at] if kind == "g" else _draw(inp.target_probs.float(), inp.uniforms, at)
        inp.parents.append(parents)
        row += n + 1
    return inp


def _run_case(vocab: int, dtype: str, seqs: list, trees: bool = False, *, seed: int) -> dict:
    from engine.spec.rejection import verify
    from engine.spec.triton_rejection import triton_verify

    inp = _make_input(vocab, dtype, seqs, seed)
    if trees:
        inp = _with_trees(inp, seqs, seed)
    expected = verify(inp)
    got = triton_verify(inp)
    forced = [(i, k) for i, (_, _, k) in enumerate(seqs) if k is not None and not trees]
    return {
        "tokens": got.tokens,
        "expected_tokens": expected.tokens,
        "path": got.paths,
        "expected_path": expected.paths,
        # The forced outcomes hold in the reference, so the case covers what it claims to.
        "forced_hold": all(len(expected.paths[i]) == k for i, k in forced),
        # Some accepted path leaves the chain (a tree case covers what it claims to).
        "branches": any(p != list(range(len(p))) for p in expected.paths),
    }


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for i, (name, *args) in enumerate(CASES):
        try:
            results[name] = _run_case(*args, seed=i)
        except Exception as e:  # report per case so one failure does not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results))


@pytest.fixture(scope="module")
def results() -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_triton_rejection"],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_verify_matches_torch_reference(results: dict, name: str) -> None:
    result = results[name]
    assert "error" not in result, result.get("error")
    assert result["forced_hold"], f"{name}: forced acceptances do not hold: {result['expected_path']}"
    assert result["tokens"] == result["expected_tokens"]
    assert result["path"] == result["expected_path"]
    assert result["branches"] or not name.startswith("trees"), f"{name}: every accepted path is a chain prefix"


if __name__ == "__main__":
    _main()
