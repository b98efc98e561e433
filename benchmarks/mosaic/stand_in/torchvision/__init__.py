"""A stand-in for torchvision, for benchmarks/data.py's Mosaic ranks only (see install.sh).

mosaicml-streaming imports torchvision when it is imported (its vision data sets); there is
no CPU build of torchvision here, and the benchmark reads tokens, never images. Using
anything here is an error."""
