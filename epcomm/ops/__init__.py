"""One module per kernel family (layout, intranode, internode, low_latency): Params mirror,
specialisation, launch. `registry.OPS_MODULES` lists them for `python -m epcomm.jit --precompile`."""
