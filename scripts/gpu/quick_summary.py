"""The quick GPU run's summary: each figure next to its target, from what the steps wrote.

Reads WORK (scripts/gpu/quick.sh's work folder): steps.tsv (step, rc, seconds, timeout),
device.txt, tests.xml (pytest's JUnit report; tests.log when the run was cut before it was
written), anchor.log (static_decode_anchor.py), batched.json and batched2k.json (bench
batched), pressure.json (bench pressure), throughput_on.json and throughput_off.json (bench
throughput). Writes OUT/summary.txt (a Markdown table a note can quote) and OUT/results.json
(every figure read). What a step did not write is reported as not run, never guessed.

Usage: python scripts/gpu/quick_summary.py WORK OUT
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from typing import Any

# (batch, context) -> kvserve decode S_TG over the yardstick's tok/s, at least
DECODE_TARGETS = {(1, 512): 0.9, (64, 512): 0.9, (256, 512): 0.9, (64, 2048): 0.8}
HOST_VS_UNCONSTRAINED = 0.9
HOST_VS_RECOMPUTE = 1.0
ROOFLINE_FRACTION = 0.35
ANCHOR_LINE = re.compile(r"B=(\d+) context=(\d+): graph ([\d.]+) ms/step = ([\d,]+) tok/s")
TEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def _read(work: str, name: str) -> str | None:
    try:
        with open(os.path.join(work, name), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _json(work: str, name: str) -> dict[str, Any] | None:
    text = _read(work, name)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def steps(work: str) -> list[dict[str, Any]]:
    rows = []
    for line in (_read(work, "steps.tsv") or "").splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            rows.append({"step": parts[0], "rc": parts[1], "seconds": int(parts[2]),
                         "timeout": int(parts[3])})
    return rows


def anchor(work: str) -> dict[tuple[int, int], dict[str, float]]:
    out = {}
    for m in ANCHOR_LINE.finditer(_read(work, "anchor.log") or ""):
        out[(int(m[1]), int(m[2]))] = {"ms_per_step": float(m[3]),
                                       "tok_s": float(m[4].replace(",", ""))}
    return out


def decode_rows(work: str) -> dict[tuple[int, int], dict[str, Any]]:
    out = {}
    for name in ("batched.json", "batched2k.json"):
        for r in (_json(work, name) or {}).get("results", []):
            out[(int(r["B"]), int(r["PP"]))] = r
    return out


def tests(work: str) -> dict[str, Any] | None:
    """Counts from the JUnit report, or from the -v log lines when there is no report."""
    text = _read(work, "tests.xml")
    if text is not None:
        try:
            root = ET.fromstring(text)
        except ET.ParseError:
            root = None
        if root is not None:
            res: dict[str, Any] = {"source": "tests.xml", "passed": 0, "failed": [],
                                   "skipped": [], "seconds": 0.0}
            for suite in root.iter("testsuite"):
                res["seconds"] += float(suite.get("time", 0))
            for case in root.iter("testcase"):
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                bad = case.find("failure") if case.find("failure") is not None else case.find("error")
                skip = case.find("skipped")
                if bad is not None:
                    res["failed"].append(name)
                elif skip is not None:
                    res["skipped"].append(f"{name}: {skip.get('message', '')}")
                else:
                    res["passed"] += 1
            return res
    log = _read(work, "tests.log")
    if log is None:
        return None
    res = {"source": "tests.log (no JUnit report: cut short?)", "passed": 0, "failed": [],
           "skipped": [], "seconds": None}
    for line in log.splitlines():
        m = TEST_LINE.match(line)
        if m is None:
            continue
        if m[2] in ("PASSED", "XFAIL"):
            res["passed"] += 1
        elif m[2] == "SKIPPED":
            res["skipped"].append(m[1])
        else:
            res["failed"].append(m[1])
    return res


def _n(x: float) -> str:
    """A figure as a note quotes it: thousands separated, three digits where it is small."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _met(ok: bool | None) -> str:
    return "not run" if ok is None else ("yes" if ok else "**MISS**")


def summarize(work: str) -> tuple[str, dict[str, Any]]:
    device = (_read(work, "device.txt") or "device: not recorded").strip()
    st, yard, dec = steps(work), anchor(work), decode_rows(work)
    pr, ton, toff = (_json(work, n) for n in ("pressure.json", "throughput_on.json",
                                              "throughput_off.json"))
    ts = tests(work)
    rows: list[tuple[str, str, str, str, str, str]] = []
    verdicts: list[tuple[str, bool | None]] = []

    for (b, ctx), target in DECODE_TARGETS.items():
        what = f"decode S_TG, B={b}, ctx {ctx}"
        r, y = dec.get((b, ctx)), yard.get((b, ctx))
        kv = f"{_n(r['S_TG'])} tok/s" if r else "not run"
        ref = f"{_n(y['tok_s'])} tok/s ({y['ms_per_step']:.3f} ms/step)" if y else "not run"
        ratio = r["S_TG"] / y["tok_s"] if r and y else None
        roof = f", {r['FRAC_TG']:.1%} of roofline" if r and "FRAC_TG" in r else ""
        ok = None if ratio is None else ratio >= target
        rows.append((what, kv + roof, "yardstick " + ref, "" if ratio is None else f"{ratio:.2f}x",
                     f">= {target}x", _met(ok)))
        verdicts.append((what, ok))

    runs = (pr or {}).get("runs", {})
    host, unc, rec = runs.get("host_tier"), runs.get("unconstrained"), runs.get("recompute")
    if host and unc and rec:
        w = pr["workload"]
        load = f" ({w['num_prompts']} x {w['input_len']} -> {w['output_len']}, device KV {w['device_fraction']:.0%} of need)"
        hv = host["vs_unconstrained"]
        rows.append(("host tier vs unconstrained" + load, f"{_n(host['output_tokens_per_s'])} out tok/s",
                     f"unconstrained {_n(unc['output_tokens_per_s'])}", f"{hv:.2f}x",
                     f">= {HOST_VS_UNCONSTRAINED}x", _met(hv >= HOST_VS_UNCONSTRAINED)))
        rv = host["vs_recompute"]
        rows.append(("host tier vs recompute", f"{_n(host['output_tokens_per_s'])} out tok/s",
                     f"recompute {_n(rec['output_tokens_per_s'])} ({rec['vs_unconstrained']:.2f}x unconstrained)",
                     f"{rv:.2f}x", f">= {HOST_VS_RECOMPUTE}x", _met(rv >= HOST_VS_RECOMPUTE)))
        verdicts += [("host tier vs unconstrained", hv >= HOST_VS_UNCONSTRAINED),
                     ("host tier vs recompute", rv >= HOST_VS_RECOMPUTE)]
    else:
        for what, t in (("host tier vs unconstrained", HOST_VS_UNCONSTRAINED),
                        ("host tier vs recompute", HOST_VS_RECOMPUTE)):
            rows.append((what, "not run", "", "", f">= {t}x", _met(None)))
            verdicts.append((what, None))

    kv_on = (ton or {}).get("kvserve")
    what = "LLM.generate (bench throughput), async scheduling on"
    if kv_on and "roofline_fraction" in kv_on:
        w = ton["workload"]
        frac = kv_on["roofline_fraction"]
        rows.append((f"{what}, {w['num_seqs']} x {w['input_len']} -> {w['output_len']}",
                     f"{_n(kv_on['output_tokens_per_s'])} out tok/s",
                     f"roofline {_n(kv_on['roofline_out_tokens_per_s'])} ({_n(kv_on['copy_gbps'])} GB/s copy)",
                     f"{frac:.1%}", f">= {ROOFLINE_FRACTION:.0%}", _met(frac >= ROOFLINE_FRACTION)))
        verdicts.append((what, frac >= ROOFLINE_FRACTION))
    else:
        kv = f"{_n(kv_on['output_tokens_per_s'])} out tok/s (no roofline: not CUDA)" if kv_on else "not run"
        rows.append((what, kv, "", "", f">= {ROOFLINE_FRACTION:.0%}", _met(None)))
        verdicts.append((what, None))

    what = "CUDA tests"
    if ts is not None:
        n_f, n_s = len(ts["failed"]), len(ts["skipped"])
        # none ran (collected only, or none selected): not run; cut short: not all green
        ok = None if ts["passed"] + n_f + n_s == 0 else (n_f == 0 and ts["source"] == "tests.xml")
        secs = f" in {ts['seconds']:.0f} s" if ts["seconds"] is not None else ""
        rows.append((what, f"{ts['passed']} passed, {n_f} failed, {n_s} skipped{secs}",
                     ts["source"], "", "all green", _met(ok)))
        verdicts.append((what, ok))
    else:
        rows.append((what, "not run", "", "", "all green", _met(None)))
        verdicts.append((what, None))

    lines = [f"# kvserve quick GPU run: {device}", ""]
    lines.append("steps (rc, seconds / timeout): " + "; ".join(
        f"{s['step']} {s['rc']} {s['seconds']}/{s['timeout']}s" for s in st) if st else "steps: none recorded")
    lines += ["", "| measure | kvserve | reference | ratio | target | met |", "|---|---:|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    met = sum(ok is True for _, ok in verdicts)
    missed = [w for w, ok in verdicts if ok is False]
    unrun = [w for w, ok in verdicts if ok is None]
    lines += ["", f"targets met: {met} of {len(verdicts)}"
              + (f"; missed: {'; '.join(missed)}" if missed else "")
              + (f"; not run: {'; '.join(unrun)}" if unrun else "")]
    lines += _details(dec, pr, ton, toff, ts)
    results = {"device": device, "steps": st, "anchor": {f"{b}x{c}": v for (b, c), v in yard.items()},
               "batched": {f"{b}x{c}": v for (b, c), v in dec.items()}, "pressure": pr,
               "throughput_async_on": ton, "throughput_async_off": toff, "tests": ts,
               "targets": {w: ok for w, ok in verdicts}}
    return "\n".join(lines) + "\n", results


def _details(dec: dict, pr: dict | None, ton: dict | None, toff: dict | None,
             ts: dict[str, Any] | None) -> list[str]:
    out = ["", "## details"]
    on, off = (ton or {}).get("kvserve"), (toff or {}).get("kvserve")
    if on and off:
        out.append(f"- async scheduling: on {_n(on['output_tokens_per_s'])}, off "
                   f"{_n(off['output_tokens_per_s'])} out tok/s: on/off "
                   f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x"
                   + (f"; off reaches {off['roofline_fraction']:.1%} of the roofline"
                      if "roofline_fraction" in off else ""))
    elif on or off:
        out.append("- async scheduling: only one of on / off ran")
    for (b, ctx), r in sorted(dec.items()):
        out.append(f"- bench batched B={b} PP={ctx} TG={r['TG']}: S_TG {_n(r['S_TG'])} tok/s, "
                   f"S_PP {_n(r['S_PP'])} tok/s"
                   + (f", {r['FRAC_TG']:.1%} of roofline ({_n(r['copy_GBps'])} GB/s)" if "FRAC_TG" in r else ""))
    host = ((pr or {}).get("runs") or {}).get("host_tier")
    if host:
        if "copy_out_gbps" in host:
            out.append(f"- host tier copies: device to host {host['copy_out_gbps']:.1f} GB/s "
                       f"({_n(host['copy_out_bytes'] / 1e6)} MB), host to device "
                       f"{host['copy_in_gbps']:.1f} GB/s ({_n(host['copy_in_bytes'] / 1e6)} MB)")
        out.append(f"- cost model's choices: {host['restores_copy']} restored by copy, "
                   f"{host['restores_recompute']} recomputed "
                   f"({json.dumps(host.get('restore_decisions', {}))}); evictions {host['evictions']}, "
                   f"write-backs skipped {host['writebacks_skipped']}")
        if "cost_model" in host:
            out.append("- cost model at the end: " + ", ".join(
                f"{k} {_n(v)}" for k, v in host["cost_model"].items()))
        c = pr.get("restore_vs_recompute")
        if c:
            out.append(f"- one {c['tokens']}-token stream: restore {c['restore_s_per_token'] * 1e6:.1f} us/token "
                       f"vs recompute {c['recompute_s_per_token'] * 1e6:.1f} us/token")
        for name in ("recompute", "host_tier"):
            m = pr["runs"][name].get("match_unconstrained")
            if m:
                out.append(f"- {name}: {m['identical']}/{m['of']} outputs identical to unconstrained")
    if ts:
        out += [f"- FAILED {n}" for n in ts["failed"]]
        out += [f"- skipped {n}" for n in ts["skipped"]]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    work, out = argv
    text, results = summarize(work)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
