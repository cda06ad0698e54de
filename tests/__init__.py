"""The test suite: one folder per package of megatron_qrl (tests/quant/ tests megatron_qrl/quant/,
...), tests/tools/, tests/bench/ and tests/examples/ for the scripts, tests/package/ for checks
of the whole package, tests/helpers/ for what several folders share, tests/gpu/ for the H200.
A package, so every test module has a unique dotted name (tests.<folder>.<module>)."""
