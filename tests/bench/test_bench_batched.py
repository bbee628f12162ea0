"""`kvserve bench batched`: several runs a point, the medians, and the paired ratios against the
peer's runs. The peer here is a stand-in for llama-batched-bench (a script that prints its
table and logs each call), since building llama.cpp does not fit the test run."""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Iterator

import pytest
import torch

from kvserve.bench import batched
from kvserve.bench.batched import format_comparison, median_row
from kvserve.cli import main

# Prints llama-batched-bench's header and one row for its -npp/-ntg/-npl, each of its calls
# slower than the one before (S_TG 100, 90, 80 ...), and logs its arguments.
PEER = """#!{python}
import json, os, sys
a = sys.argv[1:]
arg = lambda k: int(a[a.index(k) + 1])
pp, tg, b = arg("-npp"), arg("-ntg"), arg("-npl")
log = os.environ["PEER_LOG"]
calls = sum(1 for ln in open(log) if not ln.startswith('["kvserve"'))
with open(log, "a") as f:
    f.write(json.dumps(a) + "\\n")
s_tg = 100.0 - 10 * calls
t_tg = b * tg / s_tg
t_pp = 0.5
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")
print(f"| {{pp}} | {{tg}} | {{b}} | {{b * (pp + tg)}} | {{t_pp}} | {{b * pp / t_pp}} | {{t_tg}} | {{s_tg}} | "
      f"{{t_pp + t_tg}} | {{b * (pp + tg) / (t_pp + t_tg)}} |")
"""


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _row(pp: int, b: int, s_pp: float, s_tg: float) -> dict[str, float]:
    return {"PP": pp, "TG": 4, "B": b, "N_KV": b * (pp + 4), "T_PP": 1.0, "S_PP": s_pp,
            "T_TG": 1.0, "S_TG": s_tg, "T": 2.0, "S": 1.0}


def test_the_runs_of_a_point_become_one_row_of_medians() -> None:
    runs = [_row(8, 2, s, t) for s, t in ((300.0, 10.0), (100.0, 30.0), (200.0, 20.0))]
    runs[1]["T_PP"] = 5.0
    row = median_row(runs)
    assert (row["PP"], row["B"], row["N_KV"]) == (8, 2, 24)
    assert (row["S_PP"], row["S_TG"], row["T_PP"]) == (200.0, 20.0, 1.0)
    assert row["runs_S_PP"] == [300.0, 100.0, 200.0] and row["runs_S_TG"] == [10.0, 30.0, 20.0]


def test_the_comparison_gives_the_paired_runs_range_of_ratios() -> None:
    mine = median_row([_row(8, 1, 200.0, 20.0), _row(8, 1, 300.0, 30.0), _row(8, 1, 100.0, 10.0)])
    peer = median_row([_row(8, 1, 100.0, 10.0), _row(8, 1, 100.0, 20.0), _row(8, 1, 100.0, 40.0)])
    text = format_comparison([mine], [peer])
    line = text.splitlines()[2]
    # medians 200 / 100 and 20 / 20; paired: PP 2.0, 3.0, 1.0 and TG 2.0, 1.5, 0.25
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:6] == ["2.00", "1.00-3.00"] and cells[8:10] == ["1.00", "0.25-2.00"], cells
    assert "medians of 3 runs a point" in text
    single = format_comparison([median_row([_row(8, 1, 200.0, 20.0)])], [median_row([_row(8, 1, 100.0, 10.0)])])
    assert "paired" not in single and "medians" not in single


def test_bench_batched_alternates_with_the_peer_and_reports_medians(tmp_path, capsys,
                                                                    keep_torch_threads,
                                                                    monkeypatch) -> None:
    peer = tmp_path / "llama-batched-bench"
    peer.write_text(PEER.format(python=sys.executable))
    peer.chmod(peer.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PEER_LOG", str(log))
    out = tmp_path / "batched.json"
    argv = ["bench", "batched", "--npp", "8", "--ntg", "2", "--npl", "1,2", "--threads", "1",
            "--repeat", "3", "--no-progress", "--json", str(out), "--llama-batched-bench", str(peer)]
    real = batched.run_point

    def logged(runner, pp, tg, b, *args, **kw):  # the real point, its turn logged
        with open(log, "a") as f:
            f.write(json.dumps(["kvserve", "-npl", str(b)]) + "\n")
        return real(runner, pp, tg, b, *args, **kw)

    monkeypatch.setattr(batched, "run_point", logged)
    assert main(argv) == 0
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    # the warm-up, then per point kvserve and the peer in turn, 3 times
    assert [(c[0] == "kvserve", c[c.index("-npl") + 1]) for c in calls] == [(True, "2")] + [
        (who, b) for b in "12" for _ in range(3) for who in (True, False)]
    report = json.loads(out.read_text())
    rows, theirs = report["results"], report["llama_cpp"]
    assert [(r["PP"], r["TG"], r["B"]) for r in rows] == [(8, 2, 1), (8, 2, 2)]
    for r in rows:
        assert len(r["runs_S_TG"]) == 3 and all(s > 0 for s in r["runs_S_PP"] + r["runs_S_TG"])
        assert min(r["runs_S_TG"]) <= r["S_TG"] <= max(r["runs_S_TG"])
    # the peer's runs slow down call by call: its medians are its second runs
    assert [q["S_TG"] for q in theirs] == [90.0, 60.0]
    assert theirs[0]["runs_S_TG"] == [100.0, 90.0, 80.0]
    text = capsys.readouterr().out
    assert "medians of 3 runs a point, the engines alternating" in text


def test_bench_batched_rejects_no_runs() -> None:
    with pytest.raises(SystemExit, match="--repeat must be >= 1"):
        main(["bench", "batched", "--repeat", "0", "--no-progress"])
