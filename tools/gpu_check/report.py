"""The short table printed last: ceilings, one line per kernel case, the model throughputs, the targets and each
section's status."""

from __future__ import annotations


def _f(value, fmt: str = "{:.3g}") -> str:
    return "-" if value is None else fmt.format(value)


def _ceilings(section: dict) -> list[str]:
    res = section.get("results") or {}
    return [f"ceilings: copy {_f(res.get('copy_gbps'), '{:.0f}')} GB/s, h2d {_f(res.get('h2d_gbps'), '{:.1f}')} GB/s, "
            f"d2h {_f(res.get('d2h_gbps'), '{:.1f}')} GB/s, matmul {_f(res.get('matmul_tflops'))} TFLOP/s"]


def _kernel_line(case: dict) -> str:
    if case["status"] != "ran":
        return f"{case['name'][:58]:58} {case['status'].upper()}: {(case.get('reason') or case.get('error', ''))[:70]}"
    check = case.get("check", {})
    if "max_abs_err" in check:
        err = f"{check['max_abs_err']:.2g}/{check['tol']:.2g}"
    else:
        err = "bitwise" if check.get("bit_identical") else f"{check.get('rows_differing')} rows differ"
    timing = case.get("timing") or {}
    mine = timing.get("logits") or timing.get("triton") or {}
    full = timing.get("triton") or {}
    share = mine.get("of_matmul_ceiling") if case["kind"] == "sparse_mla" else mine.get("of_copy_ceiling")
    if case["kind"] == "experts":
        share = mine.get("of_matmul_ceiling")
    return (f"{case['name'][:58]:58} {'pass' if case.get('passed') else 'FAIL':4} {err:>17} "
            f"{_f(full.get('ms'), '{:.3f}'):>9} {_f((timing.get('torch') or {}).get('ms'), '{:.3f}'):>9} "
            f"{_f(mine.get('tflops'), '{:.1f}'):>7} {_f(mine.get('gbps'), '{:.0f}'):>6} "
            f"{_f(None if share is None else 100 * share, '{:.0f}%'):>5}")


def _model_lines(section: dict) -> list[str]:
    lines = []
    for model in section.get("models", []):
        if model["status"] != "ran":
            lines.append(f"{model['name']}: {model['status']}: {(model.get('reason') or model.get('error', ''))[:80]}")
            continue
        decode, prefill = model.get("decode", {}), model.get("prefill", {})
        for variant in ("torch", "triton", "triton_graphs"):
            rates = [decode[b][variant]["tokens_per_s"] if isinstance(decode.get(b), dict)
                     and isinstance(decode[b].get(variant), dict) else None for b in decode]
            pre = prefill.get(variant) if isinstance(prefill.get(variant), dict) else {}
            cells = " ".join(f"{b}={_f(r, '{:.1f}')}" for b, r in zip(decode, rates))
            lines.append(f"{model['name'][6:]:12} {variant:14} decode tok/s {cells:28} prefill "
                         f"{prefill.get('tokens', '')} tok/s {_f(pre.get('tokens_per_s'), '{:.0f}')}")
    return lines


def render(record: dict) -> str:
    meta, sections = record["meta"], record["sections"]
    lines = [f"gpu_check {meta.get('mode')} on {meta.get('device')}: {meta.get('elapsed_s', 0):.0f} s of a "
             f"{meta.get('budget_s', 0):.0f} s budget"]
    if meta.get("mode") == "dry":
        lines.append("(CPU, kernels in Triton's interpreter: timings are not meaningful)")
    if "ceilings" in sections:
        lines += _ceilings(sections["ceilings"])
    cases = [c for name in ("kernels", "kernels_extra") for c in sections.get(name, {}).get("cases", [])]
    if cases:
        lines.append(f"{'kernel case':58} {'chk':4} {'err/tol':>17} {'triton ms':>9} {'torch ms':>9} "
                     f"{'TFLOP/s':>7} {'GB/s':>6} {'ceil':>5}")
        lines += [_kernel_line(case) for case in cases]
    lines += _model_lines(sections.get("model", {}))
    for row in record.get("targets", []):
        met = {True: "met", False: "MISSED", None: f"not judged: {str(row.get('why'))[:60]}"}[row["met"]]
        lines.append(f"target: {row['target']}: {_f(row['value'], '{:.3f}')} vs >= {row['threshold']} "
                     f"({row['metric']}): {met}")
    status = ", ".join(f"{name} {s.get('status')}" + (f" ({s.get('reason') or s.get('error')})"
                                                      if s.get("status") != "ran" else "")
                       for name, s in sections.items())
    lines.append(f"sections: {status}")
    lines.append(f"passed: {record.get('passed')}")
    return "\n".join(lines)
