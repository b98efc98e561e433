"""The names streaming.vision imports (see the package's docstring)."""


def to_tensor(*args: object) -> None:
    raise NotImplementedError("torchvision is a stand-in here (benchmarks/mosaic)")
