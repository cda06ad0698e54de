"""How tests/conftest.py spreads the suite over the xdist workers: the Ray-starting modules in
``RAY_UNITS`` units of about equal seconds, the committed seconds file covering them."""

import json
from pathlib import Path

from tests.conftest import RAY_UNITS, SECONDS_FILE, SLOW_SECONDS, ray_units, starts_ray

ROOT = Path(__file__).resolve().parents[2]


def _write(root: Path, name: str, text: str) -> str:
    path = root / "tests" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return f"tests/{name}"


def test_ray_modules_split_into_units_of_about_equal_seconds(tmp_path):
    uses_cluster = "def f(local" + "_ray): pass\n"  # (not this module's own text)
    starts_own = "import ray\nray.init" + "(num_cpus=1)\n"
    seconds = {}
    for i, s in enumerate([500.0, 200.0, 180.0, 110.0, 100.0, 90.0, 75.0, 55.0]):
        seconds[_write(tmp_path, f"rl/test_r{i}.py", uses_cluster)] = s
    plain = _write(tmp_path, "test_plain.py", "def test_x(): pass\n")
    new = _write(tmp_path, "test_new.py", starts_own)
    units = ray_units(tmp_path, seconds)
    assert plain not in units and set(units) == {*seconds, new}
    assert len(set(units.values())) == RAY_UNITS == 2
    load = {u: sum(seconds.get(p, SLOW_SECONDS) for p, v in units.items() if v == u)
            for u in units.values()}
    # longest first onto the lighter unit (the new module costs SLOW_SECONDS = 60):
    # 500+90+75 = 665 | 200+180+110+100+60+55 = 705 (in one unit: 1,370)
    assert sorted(load.values()) == [665.0, 705.0]
    assert ray_units(tmp_path, seconds) == units  # the controller and the workers agree


def test_committed_seconds_name_every_ray_module():
    seconds = json.loads((ROOT / SECONDS_FILE).read_text())
    ray = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
           if starts_ray(p) and "/gpu/" not in str(p)}
    assert ray and ray <= set(seconds), sorted(ray - set(seconds))
