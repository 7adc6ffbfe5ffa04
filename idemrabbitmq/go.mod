module github.com/pgidem/idem/idemrabbitmq

go 1.26.0

require (
	github.com/pgidem/idem v0.1.0
	github.com/rabbitmq/amqp091-go v1.16.0
)

replace github.com/pgidem/idem => ../
