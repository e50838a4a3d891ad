// Everything in tilehal's device library.
#pragma once
#include "common.cuh"
#include "convert.cuh"
#include "fp8.cuh"
#include "mma.cuh"
#include "reduce.cuh"
#include "vec.cuh"
