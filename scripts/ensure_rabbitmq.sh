#!/usr/bin/env bash
# The RabbitMQ server binaries for the suite's RabbitMQ pass (tests/services.py ThrowawayRabbit runs
# a node of its own on a free port): installed from Debian's packages when missing. The machine's own
# RabbitMQ, if any, is never started, stopped or restarted here.
set -euo pipefail

if [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
  echo "installing rabbitmq-server"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
fi
