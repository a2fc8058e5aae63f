"""The load generator behind `pdspec bench serve`: its workload and schedule (its measurements
against a real cluster are in test_cluster.py, on the cluster there)."""

import statistics

from tools.loadgen import arrival_times, make_workload


def test_arrivals_are_a_seeded_poisson_process():
    times = arrival_times(2000, rate=4.0, seed=1)
    assert times == arrival_times(2000, rate=4.0, seed=1) and times != arrival_times(2000, rate=4.0, seed=2)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert abs(statistics.fmean(gaps) - 0.25) < 0.02  # exponential gaps with mean 1/rate
    assert abs(statistics.stdev(gaps) - 0.25) < 0.03


def test_shared_prefixes_are_drawn_at_random_per_request():
    workload = make_workload(["q1", "q2", "q3"], 400, num_prefixes=8, prefix_tokens=100)
    systems = [w[0].content for w in workload]
    assert systems == [w[0].content for w in make_workload(["q1", "q2", "q3"], 400, 8, 100)]  # seeded
    assert systems != [w[0].content for w in make_workload(["q1", "q2", "q3"], 400, 8, 100, seed=1)]
    assert 30 < min(systems.count(s) for s in set(systems)) and len(set(systems)) == 8
    # Not a cycle a round-robin router would line up with: prefixes do not follow request parity.
    assert set(systems[0::2]) == set(systems[1::2])
    assert [w[1].content for w in workload[:7]] == ["q1", "q2", "q3", "q1", "q2", "q3", "q1"]
    assert all(len(w) == 1 for w in make_workload(["q"], 3))  # no prefix: the question alone
