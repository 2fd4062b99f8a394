"""Local ``evaluate`` metric modules, loadable offline by path (see :func:`hf_magicdec.ruler.load_metric`)."""
