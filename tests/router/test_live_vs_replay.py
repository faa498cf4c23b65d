"""The replay and a live fleet agree on which policy reuses the cache more, for the same requests.

Runs ``tests/bench/bench_live_vs_replay.py``'s pieces on a tiny workload: one seeded
multi-turn chat (6 conversations x 4 turns over 2 shared system prompts) written as a
replay trace and replayed, then sent at the same times to 3 real ``kvroute sim`` pods
(``--time-scale 1``, real HTTP, KV events over ZMQ) behind a real ``kvroute serve``
with ``precise_prefix`` and with ``round_robin``.  The pods' own prefix-cache counters
give the live hit rate.  No timing is asserted: only the hit-rate ordering and that
each live hit rate lands near the replay's.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.fixtures.tokenizers.build import fixture_dirs
from tests.support.bench_module import load_bench


def _bench() -> ModuleType:
    return load_bench("bench_live_vs_replay")


@pytest.mark.slow
def test_replay_and_live_order_policies_alike_by_hit_rate(tmp_path: Path) -> None:
    bench = _bench()
    shape = [
        *["--conversations", "6", "--turns", "4", "--prefixes", "2", "--prefix-words", "100"],
        *["--user-words", "150", "--answer-words", "100", "--think-s", "1.0", "--ramp-s", "1.0"],
    ]
    args = bench.parse_args(
        [*shape, "--pods", "3", "--capacity-tokens", "65536", "--prefill-rate", "50000"]
    )
    args.output_tokens = args.max_tokens
    tokenizer = fixture_dirs()["chatml"]  # byte-level BPE with a chat template, ~1 s to build
    shape_fields = vars(bench.ChatShape())
    reqs = bench.generate(
        bench.ChatShape(**{f: getattr(args, f) for f in shape_fields}),
        3,
        bench.vocabulary(tokenizer),
    )
    rows = [bench.Row("precise_prefix", "precise_prefix"), bench.Row("round_robin", "round_robin")]
    replay = bench.run_replay(args, rows, bench.write_trace(reqs, tmp_path / "t.jsonl"), tokenizer)
    (tmp_path / "logs").mkdir()
    live = {
        r.name: bench.run_live(
            args, r, replay[r.name]["params"], reqs, 3, 0, tokenizer, tmp_path / "logs"
        )
        for r in rows
    }
    for r in rows:
        print(
            f"{r.name}: replay {replay[r.name]['hit_rate']:.3f}, live {live[r.name].hit_rate:.3f}"
        )
        assert live[r.name].errors == 0
        assert abs(live[r.name].hit_rate - replay[r.name]["hit_rate"]) < 0.1
    assert replay["precise_prefix"]["hit_rate"] > replay["round_robin"]["hit_rate"] + 0.1
    assert live["precise_prefix"].hit_rate > live["round_robin"].hit_rate + 0.1


def test_kendall_tau_b_is_one_for_the_same_order_minus_one_reversed_and_corrects_ties() -> None:
    tau = _bench().kendall_tau_b
    assert tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # one tie on one side: 5 concordant pairs, 0 discordant, tau-b = 5 / sqrt(6 * 5)
    assert tau([1, 2, 3, 4], [1, 1, 3, 4]) == pytest.approx(5 / 30**0.5)
    assert math.isnan(tau([1, 1, 1], [1, 2, 3]))  # one side has no order at all


def test_pair_agreement_counts_only_pairs_the_reference_separates_by_the_margin() -> None:
    agreement = _bench().pair_agreement
    # 100 vs 105 is within 10%: not counted; 100 vs 200 and 105 vs 200 are
    assert agreement([100, 105, 200], [1, 0, 3], 0.10) == {"pairs": 2, "agree": 2}
    assert agreement([100, 105, 200], [3, 0, 1], 0.10) == {"pairs": 2, "agree": 1}
    assert agreement([100, 200], [5, 5], 0.10) == {"pairs": 1, "agree": 0}  # a live tie
