# fastamp with CUDA kernels, on the official PyTorch images.
#
#   docker build -t fastamp .
#   docker run --gpus all --rm -it -v "$PWD:/workspace/code" -v /data:/workspace/data fastamp \
#       python /workspace/code/examples/train.py --compare-torch
#   docker run --gpus all --rm fastamp torchrun --standalone --nproc_per_node=8 \
#       /opt/fastamp/examples/ddp_train.py --amp bf16
#
# Build stage: the CUDA *devel* image (nvcc, headers) compiles the extension against the image's
# torch, for the common data-centre archs. Runtime stage: the matching *runtime* image (same torch,
# so the same C++ ABI), with only the wheel installed.
ARG TORCH_IMAGE_TAG=2.11.0-cuda12.8-cudnn9
ARG BASE_DEVEL=pytorch/pytorch:${TORCH_IMAGE_TAG}-devel
ARG BASE_RUNTIME=pytorch/pytorch:${TORCH_IMAGE_TAG}-runtime

FROM ${BASE_DEVEL} AS build
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX"
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} FASTAMP_CUDA=ON FASTAMP_WERROR=ON
RUN pip install --no-cache-dir "scikit-build-core>=0.10" cmake ninja
WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md ./
COPY cmake cmake
COPY csrc csrc
COPY python python
RUN pip wheel --no-build-isolation --no-deps -w /wheels .

FROM ${BASE_RUNTIME}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl tqdm matplotlib && rm -rf /wheels
COPY examples /opt/fastamp/examples
WORKDIR /workspace
# Code and data come from the host.
VOLUME ["/workspace/code", "/workspace/data"]
# The doctor self-tests every op on every GPU against its reference; non-zero means unhealthy.
HEALTHCHECK --interval=5m --timeout=2m --start-period=30s CMD python -m fastamp doctor --quiet || exit 1
CMD ["python", "-m", "fastamp", "doctor"]
