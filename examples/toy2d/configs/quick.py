"""`--quick`: half the points (about a minute per model on 2 CPU cores); the figure
keeps its resolution."""

import dataclasses

from examples.toy2d.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(default.get_config(), n=100)
