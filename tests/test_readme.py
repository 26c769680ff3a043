"""README gives exactly two set-up commands, and CI runs the test one verbatim."""

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
