# One image for every tokenbus service; compose.yaml picks each container's command (the same
# `python -m ...` entry points `tokenbus up` starts). torch's PyPI wheel brings the CUDA runtime, so
# the image runs workers on NVIDIA GPUs (with the NVIDIA container toolkit) and on CPU alike. g++
# compiles the CPU's attention kernel for the CPU it runs on, at a worker's first start.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 \
    TOKENBUS_HOME=/tmp/tokenbus
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
# The dependencies first, in a layer of their own: a change to the sources reinstalls only tokenbus.
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], \
    sep='\n')" >/tmp/requirements.txt && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt
COPY schemas schemas
COPY bus bus
COPY text text
COPY services services
COPY workers workers
COPY kernels kernels
COPY ops ops
# /archive: the recorder's volume (compose.yaml), owned by the user here so that a new volume is too
RUN pip install --no-deps . && useradd --create-home tokenbus && install -d -o tokenbus -g tokenbus /archive
USER tokenbus

EXPOSE 8000
CMD ["python", "-m", "ops.cli", "--help"]
