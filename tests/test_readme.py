"""README gives exactly two set-up commands: CI runs the test one verbatim, and the
server one passes the argument check."""

import re

from conftest import REPO


def _setup_commands():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    install_and_serve, run_tests = _setup_commands()
    assert "sglang.launch_server" in install_and_serve and "--enable-hisparse" in install_and_serve
    assert "pytest" in run_tests
    assert run_tests in (REPO / ".ci" / "run").read_text()


def test_readme_server_command_passes_the_argument_check():
    """README's server flags, on the config-only DeepSeek-V3.2 (no GPU here:
    --device cuda is added), pass 0.5.13's check_server_args with the plugin."""
    import shlex

    from helpers_sglang import TINY_DSV32, check_server_args_cases

    install_and_serve, _ = _setup_commands()
    argv = shlex.split(install_and_serve.split("sglang.launch_server", 1)[1])
    assert argv[argv.index("--tp") + 1] == "8"
    argv[argv.index("--model-path") + 1] = str(TINY_DSV32)
    run = check_server_args_cases({"readme": {"argv": [*argv, "--device", "cuda"]}},
                                  activate=True)
    assert run["activation"]["applied"], run["activation"]["error"]
    result = run["results"]["readme"]
    assert result["ok"], result
    assert result["sparse_config"]["host_to_device_ratio"] == 2
