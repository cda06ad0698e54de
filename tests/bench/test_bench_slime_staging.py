"""The slime staging's shell side: bench/parts.sh splits a staged archive into carry-sized
parts and joins them on the device against one SHA256SUMS list; bench/slime.sh puts the
SGLang 0.5.15.post1 site before the 0.5.17 one on the slime phases' PYTHONPATH. Every bench/
staging script (slime's, Transformer Engine's, Ray's) parses."""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bash(script, cwd=ROOT, env=None):
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True)


def _split(tmp_path, size=2500, part=1000):
    data = os.urandom(size)
    src = tmp_path / "build" / "sg515.tar.xz"
    src.parent.mkdir()
    src.write_bytes(data)
    stage = tmp_path / "stage"
    r = _bash(f"source bench/parts.sh && parts_split {src} {stage} slime_sg {part}")
    assert r.returncode == 0, r.stderr
    return data, stage, int(r.stdout.strip())


def _device_dir(tmp_path, stage, n):
    """What slime-sg-part 1..n leave on the device: every carry dir's files in one dir."""
    dev = tmp_path / "device"
    dev.mkdir()
    for i in range(1, n + 1):
        for f in (stage / f"slime_sg{i}").iterdir():
            shutil.copy(f, dev)
    return dev


def _join(dev):
    return _bash(f"source bench/parts.sh && parts_join {dev} sg515.tar.xz")


def test_parts_split_one_part_per_carry_dir_and_join_back(tmp_path):
    data, stage, n = _split(tmp_path)
    assert n == 3
    assert sorted(p.name for p in stage.iterdir()) == ["slime_sg1", "slime_sg2", "slime_sg3"]
    assert [len(list((stage / f"slime_sg{i}").glob("*.part*"))) for i in (1, 2, 3)] == [1, 1, 1]
    sums = (stage / "slime_sg1" / "SHA256SUMS").read_text().split("\n")
    assert [line.split()[1] for line in sums if line] == [
        "sg515.tar.xz", "sg515.tar.xz.part00", "sg515.tar.xz.part01", "sg515.tar.xz.part02"]
    dev = _device_dir(tmp_path, stage, n)
    r = _join(dev)
    assert r.returncode == 0, r.stderr
    assert (dev / "sg515.tar.xz").read_bytes() == data


def test_a_new_split_replaces_the_old_parts(tmp_path):
    _, stage, _ = _split(tmp_path)
    (tmp_path / "build").rename(tmp_path / "old")
    _, stage, n = _split(tmp_path, size=900)
    assert n == 1 and sorted(p.name for p in stage.iterdir()) == ["slime_sg1"]


def test_a_missing_part_is_named_and_nothing_is_joined(tmp_path):
    _, stage, n = _split(tmp_path)
    dev = _device_dir(tmp_path, stage, n)
    (dev / "sg515.tar.xz.part01").unlink()
    r = _join(dev)
    assert r.returncode != 0
    assert "missing" in r.stderr and "sg515.tar.xz.part01" in r.stderr and "copy every part" in r.stderr
    assert not (dev / "sg515.tar.xz").exists()


def test_a_damaged_part_fails_the_sums(tmp_path):
    _, stage, n = _split(tmp_path)
    dev = _device_dir(tmp_path, stage, n)
    part = dev / "sg515.tar.xz.part02"
    b = bytearray(part.read_bytes())
    b[7] ^= 0xFF
    part.write_bytes(bytes(b))
    r = _join(dev)
    assert r.returncode != 0 and "does not match SHA256SUMS" in r.stderr
    assert not (dev / "sg515.tar.xz").exists()


def test_a_stale_part_of_another_staging_is_refused(tmp_path):
    _, stage, n = _split(tmp_path)
    dev = _device_dir(tmp_path, stage, n)
    (dev / "sg515.tar.xz.part03").write_bytes(b"left from a larger staging")
    r = _join(dev)
    assert r.returncode != 0 and "sg515.tar.xz.part03 is not in" in r.stderr


def test_join_without_the_sums_says_which_dir_to_copy(tmp_path):
    _, stage, n = _split(tmp_path)
    dev = _device_dir(tmp_path, stage, n)
    (dev / "SHA256SUMS").unlink()
    r = _join(dev)
    assert r.returncode != 0 and "copy the first part's carry dir first" in r.stderr


def _fake_site(path, version):
    """A site dir holding an `sglang` package and its dist-info, as the staged sites do."""
    (path / "sglang").mkdir(parents=True)
    (path / "sglang" / "__init__.py").write_text("")
    dist = path / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return path


@pytest.mark.parametrize("sg515, ok, want", [
    ("1", True, "0.5.15.post1"), ("0", True, "0.5.17"), ("1", False, "0.5.17")])
def test_slime_phases_import_the_0515_site_first_when_installed(tmp_path, sg515, ok, want):
    site517 = _fake_site(tmp_path / "site", "0.5.17")
    site515 = _fake_site(tmp_path / "sg515_site", "0.5.15.post1")
    if ok:
        (site515 / ".ok").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{site517}:{tmp_path / 'stub'}", "SG515": sg515,
           "SG515_SITE": str(site515), "OUT": str(tmp_path / "out")}
    r = _bash("phase=slime-env; source bench/slime.sh", env=env)
    assert r.returncode == 0, r.stderr
    used = next(line for line in r.stdout.splitlines() if line.startswith("SGLang "))
    site = site515 if want.startswith("0.5.15") else site517
    assert used == f"SGLang {want} from {site / 'sglang'}"
    path = next(line for line in r.stdout.splitlines() if line.startswith("PYTHONPATH="))
    entries = path.removeprefix("PYTHONPATH=").split(":")
    assert entries[0] == "/tmp/mlm"
    assert (str(site515) in entries) == (want == "0.5.15.post1")
    if want == "0.5.15.post1":
        assert entries.index(str(site515)) < entries.index(str(site517))


@pytest.mark.parametrize("pinned", [True, False])
def test_slime_pins_come_right_after_megatron_once_installed(tmp_path, pinned):
    """slime's Megatron init asserts numpy 1.x: the pins of slime's image (numpy 1.26.4) must
    come before every site holding the image's numpy 2, and only once slime-install made them."""
    pins = tmp_path / "pins"
    pins.mkdir()
    if pinned:
        (pins / ".ok").write_text("")
    site517 = _fake_site(tmp_path / "site", "0.5.17")
    env = {**os.environ, "PYTHONPATH": str(site517), "SLIME_PINS": str(pins),
           "SG515_SITE": str(tmp_path / "none"), "OUT": str(tmp_path / "out")}
    r = _bash("phase=slime-env; source bench/slime.sh", env=env)
    assert r.returncode == 0, r.stderr
    path = next(line for line in r.stdout.splitlines() if line.startswith("PYTHONPATH="))
    entries = path.removeprefix("PYTHONPATH=").split(":")
    assert (entries[1] == str(pins)) == pinned and (str(pins) in entries) == pinned


@pytest.mark.parametrize("script", ["parts.sh", "slime.sh", "stage_slime.sh", "stage_slime_sglang.sh",
                                    "stage_te.sh", "stage_ray.sh", "stage_site.sh"])
def test_bench_staging_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
