"""The four KernelBench models cupyfuse started from, as examples of the generic library.

* :mod:`cupyfuse.kernelbench.models` -- the originals (55 Matmul_MaxPool_Sum_Scale, 56
  Matmul_Sigmoid_Sum, 98 Matmul_AvgPool_GELU_Scale_Max, 39 Gemm_Scale_BatchNorm);
* :mod:`cupyfuse.kernelbench.modules` -- their fused classes (``fused_class`` of each);
* :mod:`cupyfuse.kernelbench.ops` -- the same computations as functions of tensors or
  arrays, each a generic tail program.
"""
from cupyfuse.kernelbench import models
from cupyfuse.kernelbench.modules import (FusedGemmScaleBatchNorm, FusedMatmulAvgPoolGeluScaleMax,
                                          FusedMatmulMaxPoolSumScale, FusedMatmulSigmoidSum)
from cupyfuse.kernelbench.ops import (gemm_scale_batchnorm, matmul_avgpool_gelu_scale_max,
                                      matmul_maxpool_sum_scale, matmul_sigmoid_sum)

__all__ = ["models", "FusedMatmulMaxPoolSumScale", "FusedMatmulSigmoidSum",
           "FusedMatmulAvgPoolGeluScaleMax", "FusedGemmScaleBatchNorm", "matmul_maxpool_sum_scale",
           "matmul_sigmoid_sum", "matmul_avgpool_gelu_scale_max", "gemm_scale_batchnorm"]
