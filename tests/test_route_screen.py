"""The router screening's tables: cells banded by round-robin's misses, violations pooled as
counts per band, the candidates' ratios against the goals and the worst member (hand-made
rows, no simulation)."""

from __future__ import annotations

from laps_jax.sim.route_screen import markdown, pooled


def rows_for(member: str, n: int, load: float, viol: dict[str, int], done: int = 100,
             seed: int | None = None):
    extra = {} if seed is None else {"seed": seed}
    return [{"member": member, "n": n, "load": load, "policy": p, "completed": done,
             "violations": v, "tok_s": 1000.0, **extra} for p, v in viol.items()]


def test_bands_pool_counts_and_the_worst_member_is_named():
    base = {"least-load": 0, "bucket": 0}
    rows = (rows_for("a", 2, 0.5, {"round-robin": 10, "prefix": 8, "laps": 5, **base})
            + rows_for("a", 4, 0.5, {"round-robin": 0, "prefix": 2, "laps": 1, **base})
            + rows_for("b", 2, 0.9, {"round-robin": 60, "prefix": 50, "laps": 55, **base}))
    g = pooled(rows)
    # member a's two cells are light (RR 10% and 0%): counts add, not rates
    assert g[("a", "light")]["laps"][:2] == [6, 200]
    assert g[("a", "light")]["round-robin"][:2] == [10, 200]
    assert ("b", "heavy") in g and ("all members", "heavy") in g
    md = markdown(rows)
    # a light: 6/10 = 0.60 <= 0.72 vs RR; 6/10 vs prefix = 0.60; b heavy: 55/50 = 1.10 > 1.0
    assert "| a | light | 2 |" in md and "0.60" in md
    assert "laps / prefix, heavy blocks: worst member b 1.10 (goal <= 1.0: missed)" in md
    assert "laps / round-robin, light blocks: worst member a 0.60 (goal <= 0.72: met)" in md


def test_a_ratio_of_a_few_misses_is_shown_but_not_judged():
    base = {"least-load": 0, "bucket": 0}
    rows = (rows_for("quiet", 2, 0.5, {"round-robin": 1, "prefix": 0, "laps": 1, **base})
            + rows_for("busy", 2, 0.5, {"round-robin": 10, "prefix": 9, "laps": 6, **base}))
    md = markdown(rows)
    assert "few (1 vs 1)" in md and "few (1 vs 0)" in md
    # the worst member in light blocks is the one with misses enough to count
    assert "laps / round-robin, light blocks: worst member busy 0.60 (goal <= 0.72: met)" in md


def test_seeds_of_one_cell_pool_each_in_its_own_band(tmp_path):
    """The same cell under two seeds is two cells: each banded by its own round-robin rate,
    their counts added, neither replacing the other when the files are merged."""
    import json
    from laps_jax.sim.route_screen import merge_rows
    base = {"least-load": 0, "bucket": 0}
    files = []
    for seed, viol in ((0, {"round-robin": 10, "prefix": 8, "laps": 4}),
                       (1, {"round-robin": 12, "prefix": 10, "laps": 9}),
                       (2, {"round-robin": 70, "prefix": 50, "laps": 60})):
        path = tmp_path / f"seed_{seed}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n"
                                for r in rows_for("a", 2, 0.5, {**viol, **base}, seed=seed)))
        files.append(str(path))
    g = pooled(merge_rows(files))
    assert g[("a", "light")]["laps"][:2] == [13, 200]     # seeds 0 and 1: 10% and 12% RR
    assert g[("a", "light")]["prefix"][:2] == [18, 200]
    assert g[("a", "heavy")]["laps"][:2] == [60, 100]     # seed 2: 70% RR
    md = markdown(merge_rows(files))
    assert "| a | light | 2 |" in md and "| a | heavy | 1 |" in md
    # rows without a seed are seed 0: a later file's row replaces them
    assert len(merge_rows([files[0], files[0]])) == 5


def test_tails_are_the_geometric_mean_of_per_cell_ratios_against_prefix():
    """A candidate twice prefix's p99 in one cell and half of it in another is level (1.00),
    not ahead or behind as a mean of the milliseconds would say; a cell without the figures
    is left out, and each cell counts in its own band."""
    from laps_jax.sim.route_screen import tails
    base = {"least-load": 0, "bucket": 0}

    def cell(n, rr_viol, prefix_ms, laps_ms, with_tails=True):
        rows = rows_for("a", n, 0.5, {"round-robin": rr_viol, "prefix": 5, "laps": 5, **base})
        for r in rows:
            ms = {"prefix": prefix_ms, "laps": laps_ms}.get(r["policy"])
            if ms is not None and with_tails:
                r.update(ttft_ms_p90=ms[0], ttft_ms_p99=ms[1], ttft_ms_mean=ms[2])
        return rows

    rows = (cell(2, 10, (100, 1000, 50), (50, 2000, 50))      # light
            + cell(4, 10, (100, 4000, 40), (200, 2000, 10))   # light
            + cell(8, 10, (1, 1, 1), (9, 9, 9), with_tails=False)
            + cell(16, 80, (300, 600, 90), (150, 300, 30)))   # heavy
    t = tails(rows)
    (p90, p99, mean), n = t[("a", "light")]["laps"]
    assert n == 2
    assert abs(p90 - 1.0) < 1e-9 and abs(p99 - 1.0) < 1e-9 and abs(mean - 0.5) < 1e-9
    (p90, p99, mean), n = t[("all members", "heavy")]["laps"]
    assert n == 1 and abs(p90 - 0.5) < 1e-9 and abs(mean - 1 / 3) < 1e-9
    md = markdown(rows)
    assert "| a | light (2 cells) | 1.00 | 1.00 | 0.50 |" in md


def test_a_policy_run_on_only_some_members_is_left_out_not_pooled_over_other_cells():
    """Members screened later with fewer policies: pooling the missing one over the cells it
    ran on, against baselines over all cells, would compare different traffic."""
    base = {"least-load": 0, "bucket": 0}
    rows = (rows_for("old", 2, 0.5, {"round-robin": 10, "prefix": 8, "laps": 1,
                                     "laps-inflow": 4, **base})
            + rows_for("new", 2, 0.5, {"round-robin": 10, "prefix": 10, "laps-inflow": 5,
                                       **base}))
    md = markdown(rows)
    assert md.startswith("Left out, as not run on every cell: laps.")
    assert "laps viol." not in md and "laps-inflow viol." in md
    # laps-inflow pooled over both members: 9 of 20 against prefix's 18 and RR's 20
    assert "| all members | light | 2 | 20/200 | 0/200 | 18/200 | 0/200 | 9/200 | 0.45 | 0.50 |" in md
