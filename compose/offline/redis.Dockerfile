# Stands in for the official redis image where no registry can be reached: Debian bookworm's
# redis-server (7.0), run like the official image's (user redis, working directory /data, port 6379).
ARG BASE_IMAGE=local/debian-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data /usr/local/etc/redis && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
