"""`confgen simulate` / `python -m confgen.simulate`: flags, YAML config, serve, clean exit."""

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from confgen.simulate import SpecError
from confgen.simulate._cli import build_parser, spec_from_args

from ._helpers import complete, session


def test_flags_build_the_fleet_spec() -> None:
    """--workers/--engine/--base-port/--speed (cycled)/--seed map onto the FleetSpec."""
    args = build_parser().parse_args(
        ["--workers", "4", "--engine", "sglang", "--base-port", "8001", "--speed", "1,0.5", "--seed", "7"]
    )
    spec = spec_from_args(args)
    assert spec.seed == 7
    assert [w.port for w in spec.workers] == [8001, 8002, 8003, 8004]
    assert [w.speed for w in spec.workers] == [1.0, 0.5, 1.0, 0.5]
    assert {w.engine for w in spec.workers} == {"sglang"}


def test_yaml_config_with_defaults_counts_and_faults(tmp_path: Path) -> None:
    """--config: defaults merged into workers, count expands, faults parsed, unknown keys refused."""
    config = tmp_path / "fleet.yaml"
    config.write_text(
        "seed: 3\n"
        "defaults: {engine: vllm, models: [m1], max_num_seqs: 8}\n"
        "workers:\n"
        "  - {name: a100, speed: 1.0}\n"
        "  - {name: a10, speed: 0.5, count: 2, initial_fault: {mode: slow_start, seconds: 2}}\n"
        "  - {engine: tgi, fault_schedule: [{at_s: 5, mode: crash}]}\n"
    )
    spec = spec_from_args(build_parser().parse_args(["--config", str(config), "--seed", "9"]))
    named = spec.named_workers()
    assert spec.seed == 9
    assert [w.name for w in named] == ["a100", "a10-0", "a10-1", "tgi-3"]
    assert named[1].initial_fault is not None and named[1].initial_fault.mode == "slow_start"
    assert named[3].fault_schedule[0].fault.mode == "crash"
    assert all(w.max_num_seqs == 8 for w in named)
    config.write_text("workers: [{name: x, colour: red}]\n")
    with pytest.raises(SpecError, match="colour"):
        spec_from_args(build_parser().parse_args(["--config", str(config)]))


def test_module_serves_until_sigterm() -> None:
    """python -m confgen.simulate prints worker URLs, serves them, exits 0 on SIGTERM."""

    repo = str(Path(__file__).resolve().parents[2])

    async def run() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "confgen.simulate", "--workers", "3", "--engine", "llamacpp",
            "--seed", "5", "--decode-ms", "1",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=repo,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            lines: list[str] = []
            while not lines or lines[-1] != "ready":
                line = await asyncio.wait_for(proc.stdout.readline(), timeout=15)
                assert line, "simulator exited before it was ready"
                lines.append(line.decode().strip())
            urls = [line.split("\t")[2] for line in lines if line.startswith("llamacpp-")]
            assert len(urls) == 3
            assert any(line.startswith("control\thttp://127.0.0.1:") for line in lines)
            async with session() as s:
                for url in urls:
                    assert (await complete(s, url, max_tokens=2))[0] == 200
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    asyncio.run(run())


def test_bad_flags_exit_2() -> None:
    """An invalid spec is reported on stderr with exit status 2, nothing served."""
    from confgen.simulate import main

    assert main(["--workers", "0"]) == 2
