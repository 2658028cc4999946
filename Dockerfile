# syntax=docker/dockerfile:1
# The kvring image: cache node (`kvring node`), operator (`kvring operator`) and cluster admin
# API (`kvring admin`) in one.  Not built in CI (no container engine there).
#
#   docker build -t kvring:0.1.0 .                      # the image the chart and CRD default to
#   docker build --target vllm -t kvring-vllm:0.1.0 .   # vLLM with the KVRingConnector installed
#
# kvring is installed as a regular (non-editable) wheel: the repository's top-level operator/
# folder, which would shadow the standard library's `operator` module from the working
# directory, is not in the image; `python -P` keeps the working directory off sys.path anyway.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Pin the vLLM release you run; the connector follows vLLM's KV-connector API.
ARG VLLM_IMAGE=vllm/vllm-openai:latest

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml ./
COPY kvring kvring
COPY cachenode cachenode
COPY connector connector
COPY operator operator
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${VLLM_IMAGE} AS vllm
COPY --from=build /wheels /wheels
RUN python3 -m pip install --no-cache-dir --find-links /wheels /wheels/kvring-*.whl && rm -rf /wheels

FROM ${PYTHON_IMAGE} AS kvring
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvring
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels kvring
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# A read-only root filesystem works: nothing is written outside /tmp (an emptyDir in the pods).
USER 10001:10001
ENTRYPOINT ["python", "-P", "-m", "kvring.cli"]
CMD ["--help"]
