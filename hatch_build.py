"""Build hook: a wheel carries the course (``workbench.course``): the notebooks, the labs without their reference
solutions, and the benchmarks, under ``workbench/course/``. An editable install needs nothing: the checkout has
them beside the package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

# (folder of the repository, files taken from it): the labs' solutions/ is a folder, never matched by *.ipynb
COURSE = (("notebooks", "*.ipynb"), ("labs", "*.ipynb"), ("benchmarks", "*.py"), ("benchmarks", "*.json"))


class CourseBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        root = Path(self.root)
        for folder, pattern in COURSE:
            for path in sorted((root / folder).glob(pattern)):
                build_data["force_include"][str(path)] = f"workbench/course/{folder}/{path.name}"
