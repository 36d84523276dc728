# fastamp with CUDA kernels, on the official PyTorch images.
#
#   docker build -t fastamp .
#   docker run --gpus all --rm -it -v "$PWD:/workspace/code" -v /data:/workspace/data fastamp \
#       python examples/train.py --compare-torch      # the plot lands in ./fastamp_vs_torch.png
#   docker run --gpus all --rm fastamp torchrun --standalone --nproc_per_node=8 \
#       /opt/fastamp/examples/ddp_train.py --amp bf16
#
# Build stage: the CUDA *devel* image (nvcc, headers) compiles the extension against the image's
# torch, for the common data-centre archs. Runtime stage: the matching *runtime* image (same torch,
# so the same C++ ABI), with only the wheel installed.
#
# Warnings are not errors here (FASTAMP_WERROR=OFF): CI compiles with -Werror against the torch
# versions it tests (2.13 CPU, 2.14.1 CUDA), not against this image's torch and compiler, and a new
# warning from another toolchain must not break a user's image. Build with
# --build-arg FASTAMP_WERROR=ON to see them as errors.
ARG TORCH_IMAGE_TAG=2.11.0-cuda12.8-cudnn9
ARG BASE_DEVEL=pytorch/pytorch:${TORCH_IMAGE_TAG}-devel
ARG BASE_RUNTIME=pytorch/pytorch:${TORCH_IMAGE_TAG}-runtime

FROM ${BASE_DEVEL} AS build
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX"
ARG FASTAMP_WERROR=OFF
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} FASTAMP_CUDA=ON FASTAMP_WERROR=${FASTAMP_WERROR}
# Pinned to what CI builds with (the versions `make test` installs at the time of writing).
RUN pip install --no-cache-dir "scikit-build-core==1.1.2" "cmake==4.4.5" "ninja==1.13.2"
WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md LICENSE ./
COPY cmake cmake
COPY csrc csrc
COPY python python
RUN pip wheel --no-build-isolation --no-deps -w /wheels .

FROM ${BASE_RUNTIME}
COPY --from=build /wheels /wheels
# The wheel without dependencies (it needs only torch, which the image has: pip must not fetch
# another); the examples' tqdm and matplotlib *with* theirs (matplotlib imports packaging, PIL, ...).
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
 && pip install --no-cache-dir "tqdm==4.70.1" "matplotlib==3.11.2" \
 && python -c "import fastamp, matplotlib.pyplot, tqdm" \
 && rm -rf /wheels
COPY examples /opt/fastamp/examples
# Code and data come from the host; the working directory is the mounted code, so what the examples
# write (plots, checkpoints) lands on the host, not in the container's writable layer.
WORKDIR /workspace/code
VOLUME ["/workspace/code", "/workspace/data"]
# The doctor self-tests every op on every GPU against its reference; non-zero means unhealthy.
HEALTHCHECK --interval=5m --timeout=2m --start-period=30s \
  CMD ["sh", "-c", "python -m fastamp doctor --quiet || exit 1"]
CMD ["python", "-m", "fastamp", "doctor"]
