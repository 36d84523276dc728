# fastamp with CUDA kernels, on an official PyTorch CUDA devel image.
#   docker build -t fastamp .
#   docker run --gpus all --rm -v "$PWD:/workspace/code" fastamp python /workspace/code/examples/demo.py
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel

FROM ${BASE} AS build
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;9.0+PTX"
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} FASTAMP_CUDA=ON
RUN pip install --no-cache-dir "scikit-build-core>=0.10" cmake ninja
WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md ./
COPY cmake cmake
COPY csrc csrc
COPY python python
RUN pip wheel --no-build-isolation --no-deps -w /wheels .

FROM ${BASE}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/*.whl && rm -rf /wheels
WORKDIR /workspace
VOLUME ["/workspace/code", "/workspace/data"]
HEALTHCHECK CMD python -c "import fastamp; assert fastamp.build_info()['with_cuda']" || exit 1
CMD ["python", "-c", "import fastamp, pprint; pprint.pprint(fastamp.build_info())"]
