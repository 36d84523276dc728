/// @file macros.h
/// Portability macros shared by the CPU (.cpp) and CUDA (.cu) translation units.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FASTAMP_HOST_DEVICE __host__ __device__
#else
#define FASTAMP_HOST_DEVICE
#endif
