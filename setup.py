"""The build's one step pyproject.toml cannot say: the named configs live at the repository's top level
(`configs/`, beside `dinov3_core/`, `flows/`, `tasks/`), and the wheel carries them as package data of
`dinov3_core` (`dinov3_core/configs/`, found through importlib.resources: `dinov3_core.config.packaged_config_dir`)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "dinov3_core" / "configs"
        shutil.copytree(Path(__file__).parent / "configs", target, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithConfigs})
