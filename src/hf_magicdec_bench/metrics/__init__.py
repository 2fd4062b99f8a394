"""Local ``evaluate`` metric modules, loadable offline by path (see :func:`hf_magicdec_bench.ruler.load_metric`)."""
