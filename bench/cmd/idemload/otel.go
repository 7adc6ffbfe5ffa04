package main

import (
	"context"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemotel"
)

// discardSpans is a span exporter that drops what it gets: the cost
// measured is idemotel's and the SDK's, not an exporter's.
type discardSpans struct{}

func (discardSpans) ExportSpans(context.Context, []sdktrace.ReadOnlySpan) error { return nil }
func (discardSpans) Shutdown(context.Context) error                             { return nil }

// instrument sets idemotel on opts as a service would wire it: its
// Observe and OnPhase, on an SDK that samples every span (the default
// sampler) into a batch span processor, and a metric reader; the SDK is
// shut down when the receiver closes.
func (rc *receiver) instrument(opts *idem.Options) error {
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(discardSpans{}))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	rc.otelStop = func() {
		_ = tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	}
	tel, err := idemotel.New(idemotel.WithTracerProvider(tp), idemotel.WithMeterProvider(mp))
	if err != nil {
		return err
	}
	opts.Observer, opts.OnPhase = tel.Observe, tel.OnPhase
	return nil
}
