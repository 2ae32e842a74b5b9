"""Setuptools hook: installs `lightning_zeropp_guard.pth` next to the package (pyproject.toml holds
everything else). The .pth file runs `_lightning_zeropp_guard` at Python start-up when a ZEROPP_*
variable is set, so a Trainer script that never imports lightning_zeropp is told the variables
are ignored instead of training as plain DDP."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "lightning_zeropp_guard.pth"


class BuildPyWithGuard(build_py):
    """build_py, then the .pth file at the root of the build (site-packages once installed)."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).with_name(PTH)), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithGuard})
