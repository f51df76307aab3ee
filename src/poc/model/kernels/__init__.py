"""The model's GPU kernels, in Triton and Gluon, each called by one module of `model/` that holds the rule and the
CPU path: `fp8_triton` (the W8A8 quantisers, the fused norm + quantiser and the experts' FP8 GEMMs; `fp8.kernels()`
and `experts`), `fp8_gluon` (the experts' FP8 GEMMs on Hopper; `experts.gluon_kernels()`), `route_triton` (the
router's top-k; `route.kernels()`), `attn_fp8_triton` (the validators' all-FP8 attention on Hopper;
`attention.kernels()`). Importing one needs Triton; the callers import it only for CUDA tensors."""
