"""bench/layer_profile.py and train_mfu.py's MoE rows: parts named, recompute told apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.layer_profile import backward_part, forward_part, table  # noqa: E402
from bench.train_mfu import Row  # noqa: E402


def test_part_names():
    layer = "module.module.decoder.layers.3"
    assert forward_part(f"{layer}.mlp.router") == "router"
    assert forward_part(f"{layer}.mlp.experts") == "experts"
    assert forward_part(f"{layer}.mlp") == "mlp_or_moe"
    assert forward_part(f"{layer}.self_attention") == "attention"
    assert forward_part(f"{layer}.mlp.experts.linear_fc1") is None  # inside a part: its own
    assert forward_part("module.module.output_layer") == "lm_head"
    assert backward_part("GroupedLinearBackward") == "experts"
    assert backward_part("torch::autograd::AccumulateGrad") == "other"
    assert backward_part("PermuteMaskMapBackward") == "mlp_or_moe"
    assert backward_part("FusedAttnFuncBackward") == "attention"


def test_moe_row_words():
    r = Row.parse("none-mb8-gg-pf")
    assert dict(r.moe) == {"moe_grouped_gemm": True, "moe_permute_fusion": True}
    assert r.rl_step_args()[1] == "--moe-grouped-gemm --moe-permute-fusion"
    assert Row.parse("none-mb8-pf-gg").moe == r.moe  # one build per set, whatever the order
    assert Row.parse("full-mb2").moe == ()
    assert dict(Row.parse("none-mb2-ag").moe) == {"moe_token_dispatcher_type": "allgather"}


def test_aligned_and_replay_row_words():
    """``al`` / ``alk`` / ``alb`` / ``al8`` / ``alw`` / ``rp``: build-time ``--qrl-*`` words (a policy per distinct
    set, with the MoE words), passed on to rl_step.py; two aligned formats in one row refused."""
    r = Row.parse("none-mb16-st-al-rp")
    assert r.qrl == ("al", "rp") and r.replays and dict(r.moe) == {"qrl_stacked_experts": True}
    assert r.qrl_flags() == ["--qrl-train-moe-experts", "stacked", "--qrl-train-forward",
                             "aligned", "--qrl-rollout-format", "fp8", "--qrl-routing-replay",
                             "all"]
    assert r.build != Row.parse("none-mb16-st").build
    assert Row.parse("none-mb8-st-al").build == Row.parse("none-mb16-st-al").build
    assert "--qrl-train-aligned-keep-dequantized" in Row.parse("none-mb4-st-alk").rl_step_args()[2]
    assert not Row.parse("none-mb4-st-alb").replays
    assert Row.parse("none-mb16-st-alw").qrl_flags()[2:] == [
        "--qrl-train-forward", "aligned", "--qrl-rollout-format", "w4a16"]
    with pytest.raises(ValueError, match="exclude each other"):
        Row.parse("none-mb16-st-alw-al")
    flags = Row.parse("none-mb4-al8").rl_step_args()[2]
    assert "--qrl-train-aligned-backward fp8 --qrl-train-aligned-wgrad fp8" in flags
    with pytest.raises(ValueError, match="exclude each other"):
        Row.parse("none-mb4-al-alb")


def test_quantizer_kernels_are_their_own_sub_parts():
    """The aligned forward's Triton / SGLang quantizer kernels are split out of the part whose
    op launched them (``experts/quantize activations``, ``attention/Q(W)``...)."""
    from bench.layer_profile import kernel_part

    assert kernel_part("_act_token_kernel") == "quantize activations"
    assert kernel_part("_act_group_kernel") == "quantize activations"
    assert kernel_part("_per_token_group_quant_fp8") == "quantize activations"
    assert kernel_part("_dequant_rows_kernel") == "dequantize"
    assert kernel_part("_channel_kernel") == "Q(W)"
    for name in ("_channel_into_kernel", "_channel_fake_kernel", "_fp8_block_fake_kernel",
                 "_w4a16_fake_kernel", "_nvfp4_fake_kernel"):  # the fused and fake refreshes
        assert kernel_part(name) == "Q(W)", name
    assert kernel_part("void cutlass::Kernel2<sm90_gemm>") is None
    assert backward_part("GroupedRealFnBackward") == "experts"
    rows = [{"row": "a", "breakdown": {"parts_ms": {"experts/quantize activations": 1.0},
                                       "gpu_busy_ms": 1.0, "wall_ms": 2.0}}]
    assert "| experts/quantize activations | 1.0 (0.25/layer) |" in table(rows, layers=4)


def test_table_lines():
    rows = [{"row": "a", "breakdown": {"parts_ms": {"experts": 8.0, "optimizer": 2.0},
                                       "gpu_busy_ms": 10.0, "wall_ms": 12.0}}]
    text = table(rows, layers=4)
    assert "| experts | 8.0 (2.00/layer) |" in text and "| optimizer | 2.0 |" in text


def test_breakdown_on_a_tiny_moe(tmp_path):
    """The CPU attribution (each op's own CPU time): every MoE part shows up, and only the row
    with activation recompute has ``recompute:`` parts."""
    out = tmp_path / "t.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_mfu.py"), "--device", "cpu", "--model",
         "tiny_qwen3_moe", "--prompts", "2", "--n", "4", "--new-tokens", "12", "--updates", "1",
         "--rows", "none-mb4,full-mb4-ag", "--breakdown", "--no-profile", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    plain, full = rows["none-mb4"]["breakdown"]["parts_ms"], rows["full-mb4-ag"]["breakdown"]["parts_ms"]
    for part in ("router", "experts", "attention", "optimizer"):
        assert plain.get(part, 0) > 0, (part, plain)
    assert not any(p.startswith("recompute:") for p in plain)
    assert full.get("recompute:experts", 0) > 0, full
    assert rows["none-mb4"]["commit"]
    assert "| part |" in proc.stdout


def test_aligned_and_replay_rows_on_a_tiny_moe(tmp_path):
    """Stacked rows plain, aligned (fp8; the CPU runs the fake GEMM) and with routing replay
    in one call: each builds its own policy, the replay row's batch carries the engine's
    experts (its routing agreement is measured), and a second table breaks down the log-prob
    recompute."""
    out = tmp_path / "t.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_mfu.py"), "--device", "cpu", "--model",
         "tiny_qwen3_moe", "--prompts", "2", "--n", "4", "--new-tokens", "12", "--updates", "1",
         "--rows", "none-mb4-st,none-mb4-st-al,none-mb4-st-rp", "--breakdown", "--no-profile",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["none-mb4-st"]["aligned_gemm"] is None
    assert rows["none-mb4-st-al"]["aligned_gemm"] == "fake"
    assert rows["none-mb4-st-rp"]["routing_agreement"] is not None
    assert rows["none-mb4-st"]["routing_agreement"] is None  # no engine experts: not measured
    for r in ("none-mb4-st", "none-mb4-st-al", "none-mb4-st-rp"):
        assert rows[r]["breakdown_recompute"]["parts_ms"].get("experts", 0) > 0, r
        assert rows[r]["experts"] == ("AlignedStackedGroupedMLP" if r.endswith("al")
                                      else "StackedGroupedMLP")
    assert "the log-prob recompute of one micro batch" in proc.stdout


def test_each_kernel_is_charged_once_to_the_op_that_launched_it():
    """On CUDA a device kernel record goes to the part of the frontend op whose id is its
    ``linked_correlation_id`` (the deepest if ids repeat), once: the parts add up to the
    kernels' total. Charging every CPU event's ``kernels`` list (an op's and its parent's both
    listing the GEMM) counted 1,412 ms of parts for 290 ms of kernels on the H200; a range's
    own span on the GPU timeline (``qrl::...``, ``Optimizer.step#...``) is not a kernel."""
    from types import SimpleNamespace as NS

    from bench.layer_profile import UNLINKED, charge

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, id_, parent=None, device=cpu, linked=0, span=(0.0, 0.0), **kw):
        return NS(name=name, id=id_, cpu_parent=parent, device_type=device,
                  linked_correlation_id=linked, self_cpu_time_total=1.0,
                  time_range=NS(start=span[0], end=span[1]), is_user_annotation=False, **kw)

    rng = ev("qrl::experts", 1)
    rng.is_user_annotation = True
    linear = ev("aten::linear", 2, rng, kernels=[NS(name="gemm", duration=5000.0)])
    mm = ev("aten::mm", 3, linear, kernels=[NS(name="gemm", duration=5000.0)])
    dup = ev("aten::mm", 3, None)  # an id seen twice: the deeper event wins
    launch = ev("cudaLaunchKernel", 3, mm, linked=3)  # a runtime event, not a frontend op
    opt = ev("Optimizer.step#Adam.step", 4)
    adam = ev("aten::_foreach_add_", 5, opt)
    kernels = [ev("gemm", 100, device=gpu, linked=3, span=(0.0, 5000.0)),
               ev("multi_tensor_apply", 101, device=gpu, linked=5, span=(6000.0, 8000.0)),
               ev("qrl::experts", 102, device=gpu, linked=1, span=(0.0, 9000.0)),
               ev("Optimizer.step#Adam.step", 103, device=gpu, linked=4, span=(6000.0, 9000.0)),
               ev("orphan", 104, device=gpu, linked=99, span=(9000.0, 9500.0))]
    parts, _host, by_name = charge([rng, linear, dup, mm, launch, opt, adam, *kernels], cuda=True)
    assert parts == {"experts": 5.0, "optimizer": 2.0, UNLINKED: 0.5}
    assert by_name == {"gemm": 5.0, "multi_tensor_apply": 2.0, "orphan": 0.5}
    assert sum(parts.values()) == sum(by_name.values())


def _fake_events(with_attribute: bool):
    """FunctionEvents as torch builds them for a CUDA profile: an expert GEMM under a
    ``qrl::experts`` range, an optimizer kernel, the runtime calls that launched them (same
    CUDA correlation id as their kernel, on the CPU), and one CPU op whose id collides with a
    runtime call's. ``with_attribute=False`` is torch 2.11's ``FunctionEvent`` (no
    ``linked_correlation_id``); the raw Kineto events then hold the link."""
    from types import SimpleNamespace as NS

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    raw = []

    def ev(name, id_, parent=None, device=cpu, linked=0, span=(0.0, 0.0)):
        kw = {"linked_correlation_id": linked} if with_attribute else {}
        raw.append(NS(correlation_id=lambda: id_, linked_correlation_id=lambda: linked,
                      name=lambda: name, device_type=lambda: device))
        return NS(name=name, id=id_, cpu_parent=parent, device_type=device,
                  self_cpu_time_total=1.0, time_range=NS(start=span[0], end=span[1]),
                  is_user_annotation=False, **kw)

    rng = ev("qrl::experts", 1)
    mm = ev("aten::mm", 2, rng)
    opt = ev("Optimizer.step#AdamW.step", 3)
    foreach = ev("aten::_foreach_add_", 4, opt)
    launches = [ev("cudaLaunchKernel", 2, foreach, linked=4),  # CUDA id 2 = aten::mm's id
                ev("cudaLaunchKernel", 7, mm, linked=2)]
    kernels = [ev("nvjet_gemm", 7, device=gpu, linked=2, span=(0.0, 5000.0)),
               ev("multi_tensor_apply_kernel", 2, device=gpu, linked=4, span=(6000.0, 8000.0))]
    return [rng, mm, opt, foreach, *launches, *kernels], raw


def test_kernels_link_through_the_raw_kineto_events_where_function_events_lack_the_id():
    """torch 2.11 (the H200's) builds ``FunctionEvent`` without ``linked_correlation_id``: read
    as 0, every kernel was unlinked and the H200 table put all 231.8 ms in ``other``. The link
    is taken from the raw Kineto events instead; a runtime call sharing a CPU op's id is still
    no launcher."""
    from bench.layer_profile import UNLINKED, charge, links_of

    for with_attribute in (True, False):
        events, raw = _fake_events(with_attribute)
        parts, _host, by_name = charge(events, cuda=True, links=links_of(raw))
        assert parts == {"experts": 5.0, "optimizer": 2.0}, (with_attribute, parts)
        assert sum(by_name.values()) == 7.0
    events, _raw = _fake_events(with_attribute=False)
    assert charge(events, cuda=True)[0] == {UNLINKED: 7.0}  # no link source: said, not hidden


def test_function_events_find_their_raw_kineto_event():
    """What :func:`kineto_links` relies on, with torch's real events: each ``FunctionEvent``'s
    ``(id, name)`` is a raw event's ``(correlation_id(), name())``, and the raw events answer
    the calls it makes."""
    from torch.profiler import ProfilerActivity, profile

    from bench.layer_profile import kineto_links

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("qrl::experts"):
            torch.nn.functional.linear(torch.randn(4, 8), torch.randn(3, 8)).sum()
    raw = prof.profiler.kineto_results.events()
    keys = {(e.correlation_id(), e.name()) for e in raw}
    events = [e for e in prof.events() if e.name != "[memory]"]
    assert events and all((e.id, e.name) in keys for e in events)
    assert kineto_links(prof) == {}  # a CPU profile: no op is linked to another


def test_table_says_when_attribution_failed():
    """The H200 row's table (every kernel in ``other``) says so under the table."""
    failed = {"row": "none-mb16-st", "breakdown": {
        "parts_ms": {"other": 231.76}, "gpu_busy_ms": 231.8, "wall_ms": 319.2}}
    unlinked = {"row": "u", "breakdown": {
        "parts_ms": {"other (no launching op)": 200.0, "other (no launching op)/Q(W)": 2.0,
                     "experts": 10.0}, "gpu_busy_ms": 212.0, "wall_ms": 300.0}}
    fine = {"row": "ok", "breakdown": {
        "parts_ms": {"other": 40.0, "experts": 60.0}, "gpu_busy_ms": 100.0, "wall_ms": 120.0}}
    text = table([failed, unlinked, fine], layers=4)
    assert "ATTRIBUTION FAILED for none-mb16-st: 100% of 231.8 ms in `other`" in text
    assert "ATTRIBUTION FAILED for u: 95% of 212.0 ms" in text and "202.0 ms of kernels" in text
    assert "for ok" not in text
