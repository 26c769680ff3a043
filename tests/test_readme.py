"""README gives exactly two set-up commands: CI runs the test one verbatim, and the
server one passes the argument check."""

import re

from conftest import REPO


def _commands(heading):
    readme = (REPO / "README.md").read_text()
    section = readme.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def _setup_commands():
    return _commands("Set up")


def _server_argv(command):
    """A README server command's flags, on the config-only DeepSeek-V3.2 (no
    GPU here: --device cuda is added)."""
    import shlex

    from helpers_sglang import TINY_DSV32

    argv = shlex.split(command.split("sglang.launch_server", 1)[1])
    assert argv[argv.index("--tp") + 1] == "8"
    argv[argv.index("--model-path") + 1] = str(TINY_DSV32)
    return [*argv, "--device", "cuda"]


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    install_and_serve, run_tests = _setup_commands()
    assert "sglang.launch_server" in install_and_serve and "--enable-hisparse" in install_and_serve
    assert "pytest" in run_tests
    assert run_tests in (REPO / ".ci" / "run").read_text()


def test_readme_server_commands_pass_the_argument_check():
    """README's server flags (the set-up command and the PD prefill and
    decode), on the config-only DeepSeek-V3.2, pass the installed release's
    check_server_args with the plugin."""
    from helpers_sglang import check_server_args_cases

    install_and_serve, _ = _setup_commands()
    prefill, decode = _commands("PD disaggregation")
    cases = {"readme": install_and_serve, "pd_prefill": prefill, "pd_decode": decode}
    run = check_server_args_cases({name: {"argv": _server_argv(cmd)}
                                   for name, cmd in cases.items()}, activate=True)
    assert run["activation"]["applied"], run["activation"]["error"]
    results = run["results"]
    for name in cases:
        assert results[name]["ok"], (name, results[name])
    assert results["readme"]["sparse_config"]["host_to_device_ratio"] == 2
    # The PD pair: HiSparse on the decode only, both sides on Mooncake.
    assert "--enable-hisparse" in decode and "--enable-hisparse" not in prefill
    for cmd, mode in ((prefill, "prefill"), (decode, "decode")):
        assert f"--disaggregation-mode {mode}" in cmd
        assert "--disaggregation-transfer-backend mooncake" in cmd
