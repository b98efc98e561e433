"""The names streaming.vision imports (see the package's docstring)."""


class VisionDataset:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("torchvision is a stand-in here (benchmarks/mosaic)")


class CIFAR10(VisionDataset):
    pass
