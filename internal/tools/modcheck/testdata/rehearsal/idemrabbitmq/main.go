// Command idemrabbitmq hands idemrabbitmq's consumer a delivery without a
// MessageId, which it rejects to the dead-letter exchange before any
// claim: no broker and no database are needed.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemrabbitmq"
	amqp "github.com/rabbitmq/amqp091-go"
)

// acks records what the consumer answered.
type acks struct{ answers chan string }

func (a acks) Ack(uint64, bool) error { a.answers <- "ack"; return nil }
func (a acks) Nack(_ uint64, _, requeue bool) error {
	a.answers <- fmt.Sprint("nack requeue=", requeue)
	return nil
}
func (a acks) Reject(_ uint64, requeue bool) error {
	a.answers <- fmt.Sprint("reject requeue=", requeue)
	return nil
}

func main() {
	mw, err := idem.New(offlineDB(), options())
	check(err)
	c, err := idemrabbitmq.New(mw, "orders", func(context.Context, amqp.Delivery) error { return nil },
		idemrabbitmq.WithDeadLetterExchange("orders.dlx"))
	check(err)
	a := acks{answers: make(chan string, 1)}
	deliveries := make(chan amqp.Delivery, 1)
	deliveries <- amqp.Delivery{Acknowledger: a, Body: []byte(`{}`)}
	close(deliveries)
	check(c.Run(context.Background(), deliveries))
	got := <-a.answers
	fmt.Println("idemrabbitmq:", got)
	if got != "reject requeue=false" {
		os.Exit(1)
	}
}
