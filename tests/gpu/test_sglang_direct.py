"""H200: the direct sync (``sync="direct"``: the trainer's weights quantized straight into the
engine's own tensors through CUDA IPC handles) against the in-place sync, fp8, fp8_block,
int8 and w4a16 (whose live tensors are SGLang's Marlin repack: the in-place engine's come
from SGLang's own ``process_weights_after_loading``, the direct engine's from the writer).

    source .stage/recipe/setup.sh
    PYTHONUNBUFFERED=1 python -m pytest -q tests/gpu/test_sglang_direct.py -x -s

Per format and sync, in its own process (``python tests/gpu/test_sglang_direct.py FMT SYNC
OUT.json``): export the tiny Qwen3-MoE of test_sglang_inplace with weights A, start the engine
on it (CUDA graphs on, memory saver off), sync A (version 0) then B (version 1) through the
driver's ``rl.sync.sync_weights`` with the weights on the GPU (the in-place engine gets them
packed by the fused Triton quantizers, the direct engine quantizes them into its tensors with
``QuantSpec.quantize_into``'s torch ops), generate greedily, and save every engine parameter
as the storage service exports it (the tensors the kernels read, through their IPC handles).
The parent requires the direct engine's parameters bit-equal to the in-place engine's, the
same greedy tokens, the second direct sync reusing the handles of the first (one export), and
the read-back digest as its check; ``direct+packed`` (the packed stream copied) and
``direct+qcache`` (codes and scales quantized before the sync, as the aligned forward's Q(W)
cache holds them: copied, none quantized) the same. With the memory saver (the default
``release_memory``) CUDA IPC cannot share the memory ``torch_memory_saver`` maps with
``cuMemCreate``: ``inplace+saver`` checks on the real engine that its storage service answers
that failure to an export, and that the engine lives on (an in-place sync after a release /
resume, then the same tokens as in place); ``direct+saver`` is the direct sync written by the
engine from the trainer's tensors, across a release / resume.

Engines at ``mem_fraction_static=0.3`` must not run in parallel streams (two pytest processes
at once ran out of memory): run the file in ONE pytest process, whose in-place reference
engines are then started once per format and shared. Each case starts one engine (~40 s +
export + syncs); under a 10-minute limit per command, two runs one after the other:

    PYTHONUNBUFFERED=1 python -m pytest -q -n 0 -s tests/gpu/test_sglang_direct.py \
        -k "fp8 or memory_release"      # fp8, fp8_block (+packed, +qcache), the saver
    PYTHONUNBUFFERED=1 python -m pytest -q -n 0 -s tests/gpu/test_sglang_direct.py \
        -k "int8 or w4a16"              # int8, w4a16 (+packed)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
FORMATS = ["fp8", "fp8_block", "int8", "w4a16"]


def worker(fmt: str, sync: str, out: Path) -> None:
    """``sync``: ``inplace``, ``direct``, ``direct+packed`` (the packed stream copied),
    ``direct+qcache`` (cached codes copied), or ``inplace+saver`` (the engine with its memory
    saver, its memory released and resumed between the two syncs, as the RL loop does, and
    asked for an export after the release: ``res["export_error"]``, no ``.pt``);
    ``direct+saver`` syncs a trainer's parameters: the same CUDA tensors every sync, updated in
    place — A, A again (the engine then holds them), B (sent by name: the engine reads B
    through what it holds) — and ``sync_b`` is the third."""
    from megatron_qrl.models.export import export_quantized
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import hf_tensors
    from megatron_qrl.rl.sync import sync_weights
    from megatron_qrl.rollout import SamplingParams
    from megatron_qrl.rollout_sglang import SGLangEngine, SGLangOptions
    from tests.gpu.test_sglang_inplace import prompts, source_model

    work = out.parent / f"work-{fmt}-{sync}"
    a, b = source_model(0), source_model(1)
    a.save_pretrained(work / "hf-a")
    export_quantized(work / "hf-a", fmt, work / fmt, overwrite=True, progress=False)
    spec = get_spec(fmt)
    res: dict = {"fmt": fmt, "sync": sync}
    sync, _, option = sync.partition("+")
    saver = option == "saver"
    t0 = time.time()
    engine = SGLangEngine(work / fmt, fmt, SGLangOptions(sync=sync, release_memory=saver),
                          mem_fraction_static=0.3, random_seed=0)
    res["startup_s"] = round(time.time() - t0, 1)
    held = sync == "direct" and saver  # the trainer's parameters, held by the engine
    steps = (("a", a, 0), ("a2", a, 1), ("b", b, 2)) if held else (("a", a, 0), ("b", b, 1))
    params: list | None = None
    try:
        for tag, model, version in steps:
            if saver and version:
                engine.release_memory()
                engine.resume_memory()
            if saver and version and sync == "inplace":
                try:  # answered by the engine's storage service, which must live on
                    engine._storage_call({"what": "export"})
                except Exception as exc:  # noqa: BLE001  (recorded for the parent)
                    res["export_error"] = f"{type(exc).__name__}: {exc}"
            stream = [(n, t.cuda()) for n, t in hf_tensors(model)]
            if held:  # the same tensors every sync, their values changed in place
                if params is None:
                    params = stream
                else:
                    new = dict(stream)
                    for n, t in params:
                        t.copy_(new[n])
                stream = params
            if option == "packed":  # the packed stream, copied into the engine
                engine.update_weights(spec.pack_state_dict(
                    iter(stream), stack_experts=engine.stacked_experts), version)
            else:
                cache = ({n: spec.quantize_weight(t, name=n) for n, t in stream
                          if spec.is_quantized(n)} if option == "qcache" else {})
                sync_weights(iter(stream), engine, spec, version,
                             quantized=cache.get if cache else None)
            res[f"sync_{tag}"] = dict(engine.last_sync, version=engine.weight_version())
        o = engine.generate(prompts(), SamplingParams(max_new_tokens=16, temperature=0))
        res["ids"], res["mask"] = o.output_ids.tolist(), o.mask.tolist()
        if sync == "direct":  # fingerprints of every region written (the engine's, saver)
            res["sent"] = engine.sent_checksums()
        if not saver:
            held = engine._storage_call({"what": "export"})["tensors"]
            torch.save({n: t.detach().cpu().clone() for n, t in held.items()},
                       out.with_suffix(".pt"))
    finally:
        out.write_text(json.dumps(res))
        engine.shutdown()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    raise SystemExit(0)

import pytest  # noqa: E402

from tests.gpu import run_json_worker, skip_unless_sglang_gpu  # noqa: E402

skip_unless_sglang_gpu("SGLang direct sync tests")


_DONE: dict[tuple[str, str], Path] = {}
"""(format, sync) -> the result file of a worker already run (the in-place references)."""


def _run(fmt: str, sync: str, tmp: Path) -> tuple[dict, dict]:
    out = _DONE.get((fmt, sync)) or tmp / f"{fmt}-{sync.replace('+', '-')}.json"
    if (fmt, sync) not in _DONE:
        run_json_worker(__file__, [fmt, sync, str(out)], out, "ids",
                        f"{fmt}: the {sync} sync worker")
        _DONE[fmt, sync] = out
    pt = out.with_suffix(".pt")
    return json.loads(out.read_text()), torch.load(pt) if pt.is_file() else {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,sync", [(f, "direct") for f in FORMATS]
                         + [("fp8", "direct+packed"), ("fp8_block", "direct+qcache"),
                            ("w4a16", "direct+packed")])
def test_direct_sync_equals_inplace(tmp_path, fmt, sync):
    """Catches: a region written at the wrong offset / transpose on the real engine, a
    kernel reading storage the writer does not reach (tokens differ), handles re-taken on
    every sync; the torch ops of ``quantize_into`` on CUDA (``torch.mul(..., out=fp8)``, the
    int8 rounding) not giving the fused Triton quantizers' bits; cached codes quantized
    again."""
    ref, ref_t = _run(fmt, "inplace", tmp_path)
    got, got_t = _run(fmt, sync, tmp_path)
    sb = got["sync_b"]
    print(f"\n[{sync}] {fmt}: sync B {sb['seconds']:.3f} s (storage {sb['storage_s']:.3f}, "
          f"write {sb['write_s']:.3f}, digest {sb['digest_s']:.3f}; quantized "
          f"{sb['quantized']}, copied {sb['copied']}); in place "
          f"{ref['sync_b']['seconds']:.3f} s", flush=True)
    assert sb["verified"] == "digest" and sb["version"] == 1, sb
    assert sb["handles_taken"] == 1, f"{fmt}: the second sync took the handles again: {sb}"
    assert (sb["quantized"] > 0) == (sync == "direct") and sb["copied"] > 0, sb
    assert ref_t.keys() == got_t.keys()
    differ = [n for n in ref_t if not torch.equal(_bits(ref_t[n]), _bits(got_t[n]))]
    assert not differ, f"{fmt}: the direct sync left {len(differ)} parameters unlike in place: {differ[:5]}"
    assert got["ids"] == ref["ids"] and got["mask"] == ref["mask"], (
        f"{fmt}: greedy tokens differ between the direct and the in-place engine")


@pytest.mark.gpu
def test_direct_sync_across_a_memory_release(tmp_path):
    """The direct sync with the memory saver (the RL loop's default: release after rollouts,
    resume before the sync): the saver's memory cannot be exported (on the real engine an
    export is answered with the IPC failure as an :class:`EngineLayoutError` and the engine
    lives on: an in-place sync after it gives the in-place tokens), so the engine writes the
    trainer's tensors itself (``engine_writes``); after a release / resume its written regions
    hold the bits the trainer-side direct write leaves (fingerprints equal) and it decodes the
    in-place engine's tokens. Catches: the engine-side write missing a region after a resume
    (garbage in the re-mapped pages: tokens differ), its writer's kernels differing from the
    trainer's on CUDA, the storage service raising inside the scheduler (SGLang's watchdog
    kills the engine: the worker fails with EngineDiedError), a held parameter read stale
    through the engine's mapping (the third sync sends B by name: tokens would be A's)."""
    ref, _ = _run("fp8", "inplace", tmp_path)
    saved, _ = _run("fp8", "inplace+saver", tmp_path)
    print(f"\n[inplace+saver] fp8: export answered {saved.get('export_error')!r}", flush=True)
    assert saved["export_error"].startswith("EngineLayoutError: direct weight sync: the "
                                            "engine's parameters cannot be shared by CUDA IPC")
    assert saved["sync_b"]["version"] == 1 and saved["ids"] == ref["ids"]
    trainer_side, _ = _run("fp8", "direct", tmp_path)
    got, _ = _run("fp8", "direct+saver", tmp_path)
    sb = got["sync_b"]  # the third sync: the held parameters sent by name
    print(f"[direct+saver] fp8: sync B {sb['seconds']:.3f} s (write {sb['write_s']:.3f}, "
          f"{sb['buckets']} requests, {sb['held_refs']} tensors by name; quantized "
          f"{sb['quantized']}, copied {sb['copied']}); trainer-side direct "
          f"{trainer_side['sync_b']['seconds']:.3f} s", flush=True)
    assert sb["verified"] == "digest" and sb["version"] == 2 and sb["engine_writes"], sb
    assert sb["held_refs"] > 0 and got["sync_a2"]["held_refs"] == 0
    assert sb["quantized"] > 0 and got["sent"] == trainer_side["sent"]
    assert got["ids"] == ref["ids"] and got["mask"] == ref["mask"]
