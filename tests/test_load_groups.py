"""bench_routers.py's violations by block load, on hand-made per-block records."""

from __future__ import annotations

from laps_jax.bench.load_groups import by_load, load_markdown


def row(violations: int, requests: int = 100) -> dict:
    return {"slo_violations": violations, "completed": requests, "failed": 0,
            "slo_violation_rate": violations / requests}


BLOCKS = [  # round-robin's misses set the group: 10% light, 30% and 45% medium, 70% heavy
    {"round-robin": row(10), "laps": row(5), "smg:cache_aware": row(8)},
    {"round-robin": row(30), "laps": row(12), "smg:cache_aware": row(20)},
    {"round-robin": row(45), "laps": row(30), "smg:cache_aware": row(40)},
    {"round-robin": row(70), "laps": row(66), "smg:cache_aware": row(60)},
]


def test_blocks_are_grouped_by_round_robins_miss_rate_and_pooled():
    g = by_load(BLOCKS)
    assert list(g) == ["light", "medium", "heavy"]
    assert [g[k]["blocks"] for k in g] == [1, 2, 1]
    assert g["medium"]["routers"]["laps"] == {"violations": 42, "requests": 200}
    assert g["medium"]["routers"]["round-robin"]["violations"] == 75


def test_the_table_gives_each_groups_ratios_to_the_references():
    text = load_markdown(by_load(BLOCKS))
    laps = next(l for l in text.splitlines() if l.startswith("| laps "))
    cells = [c.strip() for c in laps.strip("|").split("|")]
    # counts light, medium, heavy; then / round-robin: 5/10, 42/75, 66/70; / smg: 5/8, 42/60,
    # 66/60
    assert cells == ["laps", "5 / 100", "42 / 200", "66 / 100", "0.50", "0.56", "0.94",
                     "0.62", "0.70", "1.10"]
    head = next(l for l in text.splitlines() if l.startswith("| router "))
    assert "| light (1 block) | medium (2 blocks) | heavy (1 block) |" in head
    assert load_markdown(by_load([{"laps": row(5)}])) == ""  # no round-robin: no groups
