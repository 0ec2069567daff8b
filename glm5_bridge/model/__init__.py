"""The GLM-5 model on megatron-core: config, the registered bridge, the layer spec, DSA attention,
R3 replay. Imports kernels/ and the leaves (compat, files, hf), never train/."""
