module github.com/pgidem/idem/internal/providertest

go 1.25.0

require (
	github.com/pgidem/idem v0.0.0
	github.com/standard-webhooks/standard-webhooks/libraries v0.0.1
	github.com/stretchr/testify v1.12.1
	github.com/stripe/stripe-go/v82 v82.5.1
)

require go.yaml.in/yaml/v3 v3.0.5 // indirect

replace github.com/pgidem/idem => ../..
