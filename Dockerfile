# The Sluice image: `sluice` built with the `kubernetes` feature (worker pods), run as a non-root
# user from a slim base. The driver (deploy/kubernetes/deployment.yaml) and the worker pods it
# creates run this same image.
#
#   docker build -t sluice:latest .
FROM rust:1.95-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --features sluice-cli/kubernetes --bin sluice \
    && cp target/release/sluice /usr/local/bin/sluice

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin sluice
COPY --from=build /usr/local/bin/sluice /usr/local/bin/sluice
USER 10001
WORKDIR /home/sluice
ENTRYPOINT ["sluice"]
CMD ["--help"]
