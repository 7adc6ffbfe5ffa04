package idemotel_test

import (
	"context"
	"fmt"
	"log"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemotel"
)

// A consumer's message handled twice with Middleware.Do: each call gets a
// span "idem <source>" with its outcome, and the phases' spans under it:
// the first runs fn, the second finds the stored answer in its claim. (An HTTP service wires the same two methods, with
// otelhttp outside the middleware; see docs/observability.md.)
func Example() {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())

	tel, err := idemotel.New(idemotel.WithTracerProvider(tp))
	if err != nil {
		log.Fatal(err)
	}
	if err := idem.Migrate(context.Background(), db, "example_keys"); err != nil {
		log.Fatal(err)
	}
	mw, err := idem.New(db, idem.Options{Table: "example_keys", Observer: tel.Observe, OnPhase: tel.OnPhase})
	if err != nil {
		log.Fatal(err)
	}
	key := idem.Key{Source: "orders", EventID: "msg-1"}
	for range 2 {
		if _, err := mw.Do(context.Background(), key, []byte("payload"), func(ctx context.Context) ([]byte, error) {
			return []byte("done"), nil // ctx carries the span idem.handler
		}); err != nil {
			log.Fatal(err)
		}
	}
	for _, s := range spans.Ended() {
		for _, a := range s.Attributes() {
			if a.Key == idemotel.AttrOutcome {
				fmt.Println(s.Name(), a.Value.AsString())
			}
		}
		if s.Name() != "idem orders" {
			fmt.Println(s.Name())
		}
	}
	// Output:
	// idem.claim
	// idem.handler
	// idem.commit
	// idem orders completed
	// idem.claim
	// idem orders replayed
}
