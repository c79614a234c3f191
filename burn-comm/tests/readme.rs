//! The example of README.md, kept compiling and checked.

use burn::backend::{Autodiff, Flex};
use burn::tensor::Tensor;
use burn_comm::{CommError, ReduceOp, launch, parallel};

#[test]
fn the_readme_example_runs() {
    let results = launch(4, |ctx| {
        // Every rank gets its communicator on the whole world...
        let world = ctx.world();
        let x = Tensor::<Flex, 2>::ones([4, 3], &Default::default()) * (ctx.rank() as f32);
        let sum = world.all_reduce(x.clone(), ReduceOp::Sum)?; // bit-identical on every rank
        let gathered = world.all_gather(x.clone(), 0)?; // [16, 3], in rank order
        let pending = world.reduce_scatter_async(x, ReduceOp::Avg, 0); // row r on rank r, later

        // ...and a mesh of named dimensions, tp varying fastest.
        let mesh = ctx.mesh(&[("dp", 2), ("tp", 2)])?;
        let tp = mesh.group("tp")?;

        // Megatron's f: identity forward, all-reduce of the gradient backward.
        let w = Tensor::<Autodiff<Flex>, 2>::ones([2, 2], &Default::default()).require_grad();
        let y = parallel::copy_to_parallel_region(w.clone(), tp)?;
        let grads = y.sum().backward();

        Ok::<_, CommError>((sum, gathered, pending.wait()?, w.grad(&grads)))
    });
    for result in results {
        let (sum, gathered, scattered, grad) = result.unwrap();
        assert_eq!(sum.to_data().to_vec::<f32>().unwrap(), vec![6.0; 12]);
        let rows: Vec<f32> = gathered.to_data().to_vec::<f32>().unwrap();
        let expected: Vec<f32> = (0..4).flat_map(|r| vec![r as f32; 12]).collect();
        assert_eq!(rows, expected);
        assert_eq!(scattered.dims(), [1, 3]);
        assert_eq!(scattered.to_data().to_vec::<f32>().unwrap(), vec![1.5; 3]);
        // The gradient of sum(w) on each of 2 tp ranks, summed by the backward all-reduce.
        assert_eq!(
            grad.unwrap().to_data().to_vec::<f32>().unwrap(),
            vec![2.0; 4]
        );
    }
}
