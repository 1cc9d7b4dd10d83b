"""Run pip as if on another platform: wheels *and* environment markers of the target.

    python tools/pip_for_platform.py macosx_14_0_arm64 install --dry-run --ignore-installed \\
        --platform macosx_14_0_arm64 --python-version 3.11 --only-binary=:all: dist/vgraph-0.2.0-py3-none-any.whl

Why: `pip install --dry-run --platform P --only-binary=:all:` picks wheels
for P but evaluates every environment marker (`sys_platform`,
`platform_machine`, ...) on the machine it runs on (pypa/pip#10050,
pypa/pip#6117), so from x86-64 Linux it asks for onnxruntime-gpu on macOS
whatever pyproject.toml says, and for torch's CUDA libraries there.  This
gives pip's own marker evaluation (its vendored `packaging`) the target's
values, then runs pip unchanged: the resolution a user on P gets, checked
from here (TESTING.md records the runs for macOS arm64 and Linux aarch64).
"""
from __future__ import annotations

import re
import sys

# Platform tag (as --platform takes it) -> the marker values a Python on that platform reports.
TARGETS = [
    (r"macosx_\d+_\d+_arm64", {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64",
                               "os_name": "posix"}),
    (r"macosx_\d+_\d+_x86_64", {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "x86_64",
                                "os_name": "posix"}),
    (r"(many|musl)linux_\d+_\d+_aarch64|manylinux2014_aarch64", {"sys_platform": "linux", "platform_system": "Linux",
                                                                 "platform_machine": "aarch64", "os_name": "posix"}),
    (r"(many|musl)linux_\d+_\d+_x86_64|manylinux2014_x86_64", {"sys_platform": "linux", "platform_system": "Linux",
                                                               "platform_machine": "x86_64", "os_name": "posix"}),
    (r"win_amd64", {"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64",
                    "os_name": "nt"}),
    (r"win_arm64", {"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "ARM64",
                    "os_name": "nt"}),
]


def marker_values(platform_tag: str) -> dict[str, str]:
    for pattern, values in TARGETS:
        if re.fullmatch(pattern, platform_tag):
            return values
    raise SystemExit(f"{platform_tag}: not a platform tag this knows ({', '.join(p for p, _ in TARGETS)})")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = marker_values(argv[0])
    from pip._internal.cli.main import main as pip_main
    from pip._vendor.packaging import markers

    host = markers.default_environment
    markers.default_environment = lambda: {**host(), **target}  # read by every Marker.evaluate()
    return pip_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
