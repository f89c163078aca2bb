"""The nnet3 model: descriptors, config language, Nnet, graph algorithms,
components and Kaldi's file formats."""
