"""Index of the rewritten KernelBench level-2 Linear-family problems, and a file loader."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent

# (KernelBench level-2 problem number, file name in this folder), by problem number.
PROBLEMS = [
    (9, "l2_09_Matmul_Subtract_Multiply_ReLU.py"),
    (12, "l2_12_Gemm_Multiply_LeakyReLU.py"),
    (14, "l2_14_Gemm_Divide_Sum_Scaling.py"),
    (18, "l2_18_Matmul_Sum_Max_AvgPool_LogSumExp_LogSumExp.py"),
    (22, "l2_22_Matmul_Scale_ResidualAdd_Clamp_LogSumExp_Mish.py"),
    (28, "l2_28_BMM_InstanceNorm_Sum_ResidualAdd_Multiply.py"),
    (29, "l2_29_Matmul_Mish_Mish.py"),
    (30, "l2_30_Gemm_GroupNorm_Hardtanh.py"),
    (33, "l2_33_Gemm_Scale_BatchNorm.py"),
    (37, "l2_37_Matmul_Swish_Sum_GroupNorm.py"),
    (39, "l2_39_Gemm_Scale_BatchNorm.py"),
    (40, "l2_40_Matmul_Scaling_ResidualAdd.py"),
    (41, "l2_41_Gemm_BatchNorm_GELU_ReLU.py"),
    (45, "l2_45_Gemm_Sigmoid_LogSumExp.py"),
    (51, "l2_51_Gemm_Subtract_GlobalAvgPool_LogSumExp_GELU_ResidualAdd.py"),
    (53, "l2_53_Gemm_Scaling_Hardtanh_GELU.py"),
    (55, "l2_55_Matmul_MaxPool_Sum_Scale.py"),
    (56, "l2_56_Matmul_Sigmoid_Sum.py"),
    (59, "l2_59_Matmul_Swish_Scaling.py"),
    (62, "l2_62_Matmul_GroupNorm_LeakyReLU_Sum.py"),
    (63, "l2_63_Gemm_ReLU_Divide.py"),
    (64, "l2_64_Gemm_LogSumExp_LeakyReLU_LeakyReLU_GELU_GELU.py"),
    (66, "l2_66_Matmul_Dropout_Softmax.py"),
    (68, "l2_68_Matmul_Min_Subtract.py"),
    (70, "l2_70_Gemm_Sigmoid_Scaling_ResidualAdd.py"),
    (75, "l2_75_Gemm_GroupNorm_Min_BiasAdd.py"),
    (76, "l2_76_Gemm_Add_ReLU.py"),
    (80, "l2_80_Gemm_Max_Subtract_GELU.py"),
    (81, "l2_81_Gemm_Swish_Divide_Clamp_Tanh_Clamp.py"),
    (84, "l2_84_Gemm_BatchNorm_Scaling_Softmax.py"),
    (86, "l2_86_Matmul_Divide_GELU.py"),
    (88, "l2_88_Gemm_GroupNorm_Swish_Multiply_Swish.py"),
    (94, "l2_94_Gemm_BiasAdd_Hardtanh_Mish_GroupNorm.py"),
    (95, "l2_95_Matmul_Add_Swish_Tanh_GELU_Hardtanh.py"),
    (97, "l2_97_Matmul_BatchNorm_BiasAdd_Divide_Swish.py"),
    (98, "l2_98_Matmul_AvgPool_GELU_Scale_Max.py"),
    (99, "l2_99_Matmul_GELU_Softmax.py"),
]


def path_of(number: int) -> Path:
    """Absolute path of the file of level-2 problem ``number``."""
    for n, name in PROBLEMS:
        if n == number:
            return HERE / name
    raise KeyError(f"level-2 problem {number} is not in the index")


def load(path) -> ModuleType:
    """Import a model file by path (a bare file name is looked up in this folder)."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = HERE / p
    mod_name = "kernelbench_" + p.stem
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {p}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
