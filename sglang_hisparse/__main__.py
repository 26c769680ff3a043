"""``python -m sglang_hisparse <command>`` (also the ``sglang-hisparse`` script)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m sglang_hisparse doctor [--sglang-root DIR] [--verbose]\n"
            "           [--kernels [--kernel-config JSON] [--kv-cache-dtype {bfloat16,fp8_e4m3}]"
            " [--layout {rows,dsv4_c4}]]\n"
            "       python -m sglang_hisparse doctor --help"
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from sglang_hisparse.doctor import main as doctor_main

        return doctor_main(rest)
    print(f"unknown command {command!r}; known: doctor", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
