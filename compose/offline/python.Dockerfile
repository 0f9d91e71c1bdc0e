# Stands in for python:3.11-slim where no registry can be reached: Debian bookworm's Python 3.11 on the
# local debootstrap base, laid out like the official image's (python and python3 on PATH, venv works).
ARG BASE_IMAGE=local/debian-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s /usr/bin/python3 /usr/local/bin/python
ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1
CMD ["python3"]
