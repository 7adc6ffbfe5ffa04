#!/usr/bin/env bash
# Makes sure the brokers the consumer modules' tests talk to answer on
# loopback: NATS with JetStream on 127.0.0.1:4222 and RabbitMQ on
# 127.0.0.1:5672 (guest/guest). Starts one that is down, with the command
# the development machines use; installs Debian's package if it is missing.
# Safe to run again.
set -euo pipefail

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
await() { # await PORT NAME
  for _ in $(seq 1 120); do
    up "$1" && return 0
    sleep 0.5
  done
  echo "ensure-brokers: $2 did not come up on 127.0.0.1:$1" >&2
  return 1
}
install() {
  echo "ensure-brokers: $1 is not installed; installing it with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "$1" >/dev/null
}

if ! up 4222; then
  command -v nats-server >/dev/null || install nats-server
  echo "ensure-brokers: starting NATS with JetStream" >&2
  mkdir -p /var/lib/nats-server
  start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
  await 4222 NATS
fi

if ! up 5672; then
  command -v rabbitmq-server >/dev/null || install rabbitmq-server
  echo "ensure-brokers: starting RabbitMQ" >&2
  rabbitmq-server -detached
  await 5672 RabbitMQ
fi
