// Command idemnats wraps a handler for an ephemeral JetStream consumer,
// which idemnats.New refuses with ErrConsumer: no NATS server is needed.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemnats"
)

// ephemeral is a consumer without a durable name.
type ephemeral struct{}

func (ephemeral) CachedInfo() *jetstream.ConsumerInfo {
	return &jetstream.ConsumerInfo{Stream: "ORDERS", Name: "k3Xq9",
		Config: jetstream.ConsumerConfig{AckPolicy: jetstream.AckExplicitPolicy}}
}

func main() {
	mw, err := idem.New(offlineDB(), options())
	check(err)
	_, err = idemnats.New(mw, ephemeral{}, func(context.Context, jetstream.Msg) error { return nil })
	fmt.Println("idemnats:", errors.Is(err, idemnats.ErrConsumer))
	if !errors.Is(err, idemnats.ErrConsumer) {
		os.Exit(1)
	}
}
